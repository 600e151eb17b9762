"""LoRA adapters over HTTP: the ``loras`` field of generations (JSON) and edits (multipart),
``GET / POST / DELETE /v1/loras`` behind the API key (paths only inside ``--lora-dir``), the
model card's list, and the 400s / 404 / 409 in OpenAI's error format."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from PIL import Image
from tiny_models.loras import random_lora, save_diffusers_lora

from diffserve.entrypoints.openai.app import create_app
from server_helpers import assert_openai_error, new_engine, serve

torch.set_num_threads(1)
MODEL = "tiny-sd3"
KEY = {"Authorization": "Bearer secret"}
FAST = {"num_inference_steps": 2, "size": "64x64", "seed": 3}


@pytest.fixture(scope="module")
def server(tiny_sd3_dir, tmp_path_factory):
    lora_dir = tmp_path_factory.mktemp("loras")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, text_encoder_3=None, tokenizer_3=None)
    for i, name in enumerate(["style", "other"]):
        save_diffusers_lora(StableDiffusion3Pipeline, lora_dir / name,
                            {"transformer": (random_lora(pipe.transformer, ("to_q", "to_v"), 2, seed=i), 2, 2.0)})
    outside = save_diffusers_lora(StableDiffusion3Pipeline, tmp_path_factory.mktemp("outside") / "x",
                                  {"transformer": (random_lora(pipe.transformer, ("to_q",), 2, seed=9), 2, 2.0)})
    engine = new_engine(tiny_sd3_dir, lora_dir=str(lora_dir), loras={"preloaded": str(lora_dir / "style")})
    with serve(create_app(engine, MODEL, api_key="secret")) as base:
        body = httpx.get(f"{base}/openapi.json").json()["paths"]["/v1/loras"]["post"]["requestBody"]
        assert body["required"] and set(body["content"]) == {"application/json"}  # served with --lora-dir
        yield base, lora_dir, outside


def _image(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"][0]["b64_json"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))), dtype=np.int16)


def test_generations_take_loras(server):
    base, lora_dir, outside = server
    post = lambda body: httpx.post(f"{base}/v1/images/generations", json=body, headers=KEY, timeout=60)  # noqa: E731
    plain = _image(post({"prompt": "a cat", **FAST}))
    styled = _image(post({"prompt": "a cat", "loras": {"preloaded": 1.0}, **FAST}))
    from_dir = _image(post({"prompt": "a cat", "loras": {"style": 1.0}, **FAST}))  # loads on first use
    assert np.abs(styled - plain).max() > 0
    assert np.abs(styled - from_dir).max() <= 1  # the same file under two names
    resp = post({"prompt": "a cat", "loras": {"nope": 1.0}, **FAST})  # a missing resource, as vLLM's unknown LoRA
    assert_openai_error(resp, 404, param="loras")
    assert resp.json()["error"]["code"] == "lora_not_found" and "unknown LoRA 'nope'" in resp.json()["error"]["message"]
    for loras, fragment in [({"style": 9.0}, "less than or equal to 4"), ({"style": "x"}, None), ("style", None)]:
        resp = post({"prompt": "a cat", "loras": loras, **FAST})
        assert_openai_error(resp, 400, param="loras")
        if fragment:
            assert fragment in resp.json()["error"]["message"]


def test_a_lora_dir_file_that_fails_to_load_is_400(server):
    """A request naming a ``--lora-dir`` file that is no LoRA (found only when it loads, after
    the request was queued) is a 400 naming ``loras``, not a 500; other requests go on."""
    base, lora_dir, _ = server
    (lora_dir / "broken.safetensors").write_bytes(b"not a safetensors file")
    post = lambda body: httpx.post(f"{base}/v1/images/generations", json=body, headers=KEY, timeout=60)  # noqa: E731
    for _ in range(2):  # the failed entry is retried, and fails the same way
        resp = post({"prompt": "a cat", "loras": {"broken": 1.0}, **FAST})
        assert_openai_error(resp, 400, param="loras", code="invalid_value")
        assert "broken" in resp.json()["error"]["message"] and "safetensors" in resp.json()["error"]["message"]
    assert post({"prompt": "a cat", "loras": {"style": 1.0}, **FAST}).status_code == 200


def test_edits_take_loras_as_a_form_field(server):
    base, _, _ = server
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 30, 200)).save(buf, format="PNG")
    files = {"image": ("in.png", buf.getvalue(), "image/png")}
    fields = {"prompt": "a cat", "num_inference_steps": "2", "seed": "1", "strength": "0.9"}
    plain = _image(httpx.post(f"{base}/v1/images/edits", data=fields, files=files, headers=KEY, timeout=60))
    styled = _image(httpx.post(f"{base}/v1/images/edits", data={**fields, "loras": json.dumps({"style": 1.5})},
                               files=files, headers=KEY, timeout=60))
    assert np.abs(styled - plain).max() > 0
    resp = httpx.post(f"{base}/v1/images/edits", data={**fields, "loras": "{not json"}, files=files, headers=KEY,
                      timeout=60)
    assert_openai_error(resp, 400, param="loras")


def test_lora_routes(server):
    base, lora_dir, outside = server
    assert httpx.get(f"{base}/v1/loras").status_code == 401  # behind the API key
    names = {e["name"] for e in httpx.get(f"{base}/v1/loras", headers=KEY).json()["data"]}
    assert "preloaded" in names
    resp = httpx.post(f"{base}/v1/loras", json={"name": "again", "path": "other"}, headers=KEY, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "ready" and resp.json()["rank"] == 2
    for path in (str(outside), "../outside", "/etc/passwd"):
        assert_openai_error(httpx.post(f"{base}/v1/loras", json={"name": "x", "path": path}, headers=KEY), 400,
                            param="path")
    assert_openai_error(httpx.post(f"{base}/v1/loras", json={"name": "x", "path": "missing"}, headers=KEY), 400,
                        param="path")
    assert_openai_error(httpx.post(f"{base}/v1/loras", json={"name": "bad/name", "path": "other"}, headers=KEY), 400,
                        param="name")
    card = httpx.get(f"{base}/v1/models", headers=KEY).json()["data"][0]
    assert {"again", "preloaded"} <= {e["name"] for e in card["loras"]} and "loras" in card["parameters"]
    assert httpx.delete(f"{base}/v1/loras/again", headers=KEY).json() == {"name": "again", "object": "lora",
                                                                           "deleted": True}
    assert_openai_error(httpx.delete(f"{base}/v1/loras/again", headers=KEY), 404, param="name")


def test_a_refused_load_leaves_no_trace(server):
    """``POST /v1/loras`` answered 400 registers nothing, and an adapter it was to replace
    stays as it was (listed ready, still applied)."""
    base, lora_dir, _ = server
    (lora_dir / "junk.safetensors").write_bytes(b"not a safetensors file")
    listing = lambda: {e["name"]: e for e in httpx.get(f"{base}/v1/loras", headers=KEY).json()["data"]}  # noqa: E731
    post = lambda body: httpx.post(f"{base}/v1/images/generations", json=body, headers=KEY, timeout=60)  # noqa: E731
    before = _image(post({"prompt": "a cat", "loras": {"preloaded": 1.0}, **FAST}))
    for name, path in [("fresh", "missing"), ("fresh", "junk.safetensors"), ("preloaded", "junk.safetensors")]:
        resp = httpx.post(f"{base}/v1/loras", json={"name": name, "path": path}, headers=KEY, timeout=60)
        assert_openai_error(resp, 400, param="path")
    entries = listing()
    assert "fresh" not in entries and entries["preloaded"]["state"] == "ready", entries
    assert entries["preloaded"]["path"].endswith("style")
    assert np.abs(_image(post({"prompt": "a cat", "loras": {"preloaded": 1.0}, **FAST})) - before).max() == 0
    assert_openai_error(post({"prompt": "a cat", "loras": {"fresh": 1.0}, **FAST}), 404, param="loras")


def test_unloading_an_adapter_in_use_is_409(server, tiny_sd3_dir):
    base, _, _ = server
    long = {"prompt": "a cat", "loras": {"preloaded": 1.0}, "num_inference_steps": 20_000, "size": "64x64"}

    def post_and_give_up():
        try:
            client.post(f"{base}/v1/images/generations", json=long, headers=KEY, timeout=5)
        except httpx.TimeoutException:
            pass  # expected: the request runs 20,000 steps

    with httpx.Client(timeout=60) as client:
        thread = threading.Thread(target=post_and_give_up, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while True:
            entry = {e["name"]: e for e in httpx.get(f"{base}/v1/loras", headers=KEY).json()["data"]}["preloaded"]
            if entry["in_use"]:
                break
            assert time.monotonic() < deadline
        resp = httpx.delete(f"{base}/v1/loras/preloaded", headers=KEY)
        assert_openai_error(resp, 409, param="name", code="lora_in_use")
        thread.join(15)  # the client gives up after 5 s: the server aborts the request


def test_builtin_adapters_cannot_be_unloaded_or_replaced_over_http(tmp_path):
    """The digits model's own ``mirror`` (origin builtin): ``DELETE`` and a ``POST`` of its name
    are 409 ``lora_builtin`` naming ``name`` and leave it serving; other names still load and
    unload, and the offline `unload_lora` still may drop it (the operator's choice)."""
    import shutil

    from diffserve.models import builtin_loras

    shutil.copytree(builtin_loras("digits")["mirror"], tmp_path / "copy")
    engine = new_engine("digits", lora_dir=str(tmp_path))
    try:
        with serve(create_app(engine, "digits", api_key="secret")) as base:
            post = lambda body: httpx.post(f"{base}/v1/loras", json=body, headers=KEY, timeout=60)  # noqa: E731
            resp = httpx.delete(f"{base}/v1/loras/mirror", headers=KEY)
            assert_openai_error(resp, 409, param="name", code="lora_builtin")
            assert "built-in" in resp.json()["error"]["message"]
            assert_openai_error(post({"name": "mirror", "path": "copy"}), 409, param="name", code="lora_builtin")
            entry = {e["name"]: e for e in httpx.get(f"{base}/v1/loras", headers=KEY).json()["data"]}["mirror"]
            assert entry["origin"] == "builtin" and entry["path"] == str(builtin_loras("digits")["mirror"])
            gen = httpx.post(f"{base}/v1/images/generations", headers=KEY, timeout=60, json={
                "prompt": "a handwritten digit 3", "loras": {"mirror": 1.0}, "num_inference_steps": 2, "size": "8x8"})
            assert gen.status_code == 200, gen.text
            assert post({"name": "mine", "path": "copy"}).status_code == 200
            assert httpx.delete(f"{base}/v1/loras/mine", headers=KEY).status_code == 200
        engine.unload_lora("mirror")
        assert "mirror" not in {e["name"] for e in engine.list_loras()}
    finally:
        engine.shutdown()
