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
import numpy as np
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


def test_samplers_over_http(servers):
    """``scheduler`` (and ``clip_skip``) over HTTP: the model card lists the samplers the model
    offers; a sampler's image equals the offline engine's and records it; names the model does
    not offer, or no sampler has, are a 400 naming ``scheduler``."""
    from server_helpers import assert_openai_error

    card = httpx.get(f"{servers.base}/v1/models").json()["data"][0]
    assert card["parameters"]["scheduler"]["enum"] == ["euler", "dpmpp_2m", "unipc"]  # digits: a flow model
    assert card["parameters"]["clip_skip"] == {"type": "integer", "minimum": 1, "maximum": 1,
                                               "capabilities": ["text-to-image", "image-edit"],
                                               "description": card["parameters"]["clip_skip"]["description"]}
    assert "eta" not in card["parameters"]  # no DDIM for a flow model
    resp = servers.client.images.generate(prompt=PROMPT, extra_body={**EXTRA, "scheduler": "unipc", "clip_skip": 1})
    data = base64.b64decode(resp.data[0].b64_json)
    fields = read_image_metadata(data)["diffserve"]
    assert (fields["scheduler"], fields["clip_skip"]) == ("unipc", 1)
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    engine = DiffusionEngine(EngineConfig(model=None, num_threads=1))
    try:
        [offline] = engine.generate(PROMPT, SamplingParams(seed=11, num_inference_steps=2, guidance_scale=3.5,
                                                           negative_prompt="the number one", scheduler="unipc",
                                                           clip_skip=1, output_type="np"))
    finally:
        engine.shutdown()
    got = np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.int16)
    assert np.abs(got - np.round(offline.images[0][..., 0] * 255)).max() <= 1
    # a name it does not offer, a name no sampler has, a wrong type: the 400 lists the model's own
    # samplers only (a wrong type used to get pydantic's list of all eight names, euler_a included)
    for scheduler in ("euler_a", "heun", 5, ["euler"], True, {"name": "euler"}):
        resp = httpx.post(f"{servers.base}/v1/images/generations", json={"prompt": PROMPT, "scheduler": scheduler})
        assert_openai_error(resp, 400, param="scheduler")
        message = resp.json()["error"]["message"]
        assert "must be one of euler, dpmpp_2m, unipc" in message and "lcm" not in message, message
