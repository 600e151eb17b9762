"""Image metadata encoding (`diffserve.media.metadata`, `image_encoding.encode_image`): the EXIF
block is one a standard EXIF reader (Pillow, piexif) decodes, the XMP packet carries the JSON,
and metadata beyond what a JPEG segment holds is left out of that segment rather than failing."""

from __future__ import annotations

import io
import json
import logging

import piexif
import pytest
from PIL import ExifTags, Image

from diffserve.core.sampling_params import SamplingParams
from diffserve.media.image_encoding import encode_image
from diffserve.media.metadata import image_metadata, read_image_metadata


def _metadata(prompt: str) -> dict[str, str]:
    params = SamplingParams(num_inference_steps=4, guidance_scale=2.0, width=8, height=8, negative_prompt="x")
    return image_metadata(prompt, params, 5, "m")


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_exif_and_xmp(fmt):
    meta = _metadata("ünïcode ✓ prompt")
    data = encode_image(Image.new("RGB", (8, 8)), fmt, metadata=meta)
    image = Image.open(io.BytesIO(data))
    comment = image.getexif().get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment]
    assert comment == b"UNICODE\x00" + meta["parameters"].encode("utf-16-be")
    assert piexif.load(image.info["exif"])["Exif"][piexif.ExifIFD.UserComment] == comment  # type UNDEFINED
    assert b"diffserve:parameters" in image.info["xmp"]
    read = read_image_metadata(data)
    assert read == {"parameters": meta["parameters"], "diffserve": json.loads(meta["diffserve"])}


def test_metadata_too_large_for_a_jpeg_segment_is_left_out_with_a_warning(caplog):
    meta = _metadata("word " * 20_000)  # 100 kB of text: over the 64 KiB of an APP1 segment
    with caplog.at_level(logging.WARNING):
        data = encode_image(Image.new("RGB", (8, 8)), "jpeg", metadata=meta)
    assert Image.open(io.BytesIO(data)).size == (8, 8)
    assert "left out of the jpeg EXIF" in caplog.text
    png = encode_image(Image.new("RGB", (8, 8)), "png", metadata=meta)
    assert read_image_metadata(png)["diffserve"]["prompt"] == "word " * 20_000
