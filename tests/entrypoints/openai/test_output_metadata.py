"""Generation metadata in every image: the server's PNG, JPEG and WebP bytes (``b64_json``,
``url``, streamed ``completed`` events, edits) carry the parameters the CLI's files carry, read
back by `read_image_metadata` (the README's reader) and by AUTOMATIC1111's "PNG Info" logic
(PNG ``parameters`` chunk, else the EXIF ``UserComment`` decoded with piexif, as A1111 does);
``--no-output-metadata`` leaves them out, on the server and in the CLI."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import httpx
import openai
import piexif
import piexif.helper
import pytest
from PIL import Image

from diffserve.entrypoints.cli import main
from diffserve.entrypoints.openai.app import create_app
from diffserve.media.image_encoding import encode_image
from diffserve.media.metadata import read_image_metadata
from diffserve.models import BUILTIN_MODELS
from server_helpers import new_engine, serve, sse_events

MODEL = "diffserve-digits"
PROMPT = 'a handwritten digit 3 — "naïve" <tag> & more'
EXTRA = {"num_inference_steps": 2, "seed": 11, "guidance_scale": 3.5, "negative_prompt": "the number one"}


def a1111_png_info(data: bytes) -> str | None:
    """What AUTOMATIC1111's "PNG Info" tab shows as the generation parameters of an image file:
    the ``parameters`` text chunk, else the EXIF UserComment decoded by piexif."""
    image = Image.open(io.BytesIO(data))
    info = dict(image.info)
    text = info.pop("parameters", None)
    if "exif" in info:
        exif = piexif.load(info["exif"])
        comment = exif.get("Exif", {}).get(piexif.ExifIFD.UserComment, b"")
        try:
            comment = piexif.helper.UserComment.load(comment)
        except ValueError:
            comment = comment.decode("utf8", errors="ignore")
        text = comment or text
    return text


@pytest.fixture(scope="module")
def servers():
    engine = new_engine(BUILTIN_MODELS["digits"])
    bare_engine = new_engine(BUILTIN_MODELS["digits"])
    with serve(create_app(engine, MODEL)) as base, serve(create_app(bare_engine, MODEL, output_metadata=False)) as bare:
        yield SimpleNamespace(base=base, bare=bare,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0),
                              bare_client=openai.OpenAI(base_url=f"{bare}/v1", api_key="x", max_retries=0))


def _check(data: bytes, image_format: str, seed: int, **more) -> dict:
    assert Image.open(io.BytesIO(data)).format == image_format
    meta = read_image_metadata(data)
    fields = meta["diffserve"]
    assert fields == {"prompt": PROMPT, "negative_prompt": "the number one", "num_inference_steps": 2,
                      "guidance_scale": 3.5, "seed": seed, "width": 8, "height": 8, "model": MODEL, **more}
    a1111 = a1111_png_info(data)
    assert a1111 == meta["parameters"]
    assert a1111.splitlines()[0] == PROMPT and "Negative prompt: the number one" in a1111
    assert f"Steps: 2, CFG scale: 3.5, Seed: {seed}, Size: 8x8, Model: {MODEL}" in a1111
    return fields


@pytest.mark.parametrize("output_format,image_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_b64_images_carry_the_cli_metadata(servers, output_format, image_format):
    resp = servers.client.images.generate(prompt=PROMPT, n=2, output_format=output_format, extra_body=EXTRA)
    for i, item in enumerate(resp.data):
        _check(base64.b64decode(item.b64_json), image_format, seed=11 + i)


def test_url_streamed_and_edited_images_carry_it(servers):
    resp = servers.client.images.generate(prompt=PROMPT, response_format="url", output_format="webp",
                                          extra_body=EXTRA)
    _check(httpx.get(resp.data[0].url).content, "WEBP", seed=11)
    with httpx.stream("POST", f"{servers.base}/v1/images/generations", timeout=60,
                      json={"prompt": PROMPT, "stream": True, "partial_images": 1, "output_format": "jpeg",
                            **EXTRA}) as response:
        events = list(sse_events(response))
    [completed] = [data for name, data in events if name == "image_generation.completed"]
    _check(base64.b64decode(completed["b64_json"]), "JPEG", seed=11)
    source = io.BytesIO(encode_image(Image.new("L", (8, 8), 128), "png"))
    edit = servers.client.images.edit(image=("in.png", source, "image/png"), prompt=PROMPT,
                                      extra_body={**EXTRA, "strength": 0.5})
    fields = _check(base64.b64decode(edit.data[0].b64_json), "PNG", seed=11, strength=0.5)
    assert "Denoising strength: 0.5" in read_image_metadata(base64.b64decode(edit.data[0].b64_json))["parameters"]


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
def test_no_output_metadata_leaves_it_out(servers, output_format):
    resp = servers.bare_client.images.generate(prompt=PROMPT, output_format=output_format, extra_body=EXTRA)
    data = base64.b64decode(resp.data[0].b64_json)
    assert read_image_metadata(data) == {"parameters": None, "diffserve": None}
    assert a1111_png_info(data) is None
    assert not {"exif", "xmp", "parameters", "diffserve"} & set(Image.open(io.BytesIO(data)).info)


def test_cli_no_output_metadata(tmp_path, capsys):
    assert main(["generate", PROMPT, "--steps", "2", "--seed", "1", "-o", str(tmp_path / "with")]) == 0
    assert main(["generate", PROMPT, "--steps", "2", "--seed", "1", "-o", str(tmp_path / "without"),
                 "--no-output-metadata", "--display-size", "16"]) == 0
    [with_meta] = (tmp_path / "with").glob("*.png")
    assert json.loads(Image.open(with_meta).text["diffserve"])["seed"] == 1
    for path in (tmp_path / "without").glob("*.png"):
        assert read_image_metadata(path.read_bytes()) == {"parameters": None, "diffserve": None}
