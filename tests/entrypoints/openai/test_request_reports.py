"""What the server reports about a request matches what the engine did: truncation flags in the
JSON response and the SSE ``completed`` events, the same images for the same seed offline, from
the CLI and over HTTP (image i = seed + i), and non-finite outputs in ``/metrics``."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.cli import main
from diffserve.entrypoints.openai.app import create_app
from server_helpers import new_engine, serve, sse_events

torch.set_num_threads(1)

LONG_NEGATIVE = " ".join(["blurry"] * 2000)


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir):
    return new_engine(tiny_sd3_dir)


@pytest.fixture(scope="module")
def offline(tiny_sd3_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), num_threads=1))


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_negative_prompt_truncation_is_reported_over_http_and_sse(engine, offline):
    body = {"prompt": "a cat", "n": 2, "num_inference_steps": 2, "guidance_scale": 5.0, "seed": 1}
    with serve(create_app(engine, "m")) as base:
        url = f"{base}/v1/images/generations"
        data = httpx.post(url, json={**body, "negative_prompt": LONG_NEGATIVE}, timeout=60).json()["data"]
        assert [(d["prompt_truncated"], d["negative_prompt_truncated"]) for d in data] == [(False, True)] * 2
        data = httpx.post(url, json={**body, "negative_prompt": "dark"}, timeout=60).json()["data"]
        assert [d["negative_prompt_truncated"] for d in data] == [False, False]
        long_both = {**body, "prompt": LONG_NEGATIVE, "negative_prompt": LONG_NEGATIVE, "stream": True}
        with httpx.stream("POST", url, json=long_both, timeout=60) as stream:
            completed = [data for name, data in sse_events(stream) if name == "image_generation.completed"]
        assert len(completed) == 2
        assert all(c["prompt_truncated"] and c["negative_prompt_truncated"] for c in completed)
        spec = httpx.get(f"{base}/openapi.json").json()
        for schema in ("ImageObject", "CompletedEvent"):
            assert "negative_prompt_truncated" in spec["components"]["schemas"][schema]["properties"]
    # without guidance the negative prompt is not used, so it is not flagged
    [out] = offline.generate("a cat", SamplingParams(num_inference_steps=2, guidance_scale=1.0, seed=1,
                                                           negative_prompt=LONG_NEGATIVE))
    assert out.ok and not out.negative_prompt_truncated


def test_same_seed_same_images_offline_cli_and_http(tiny_sd3_dir, tmp_path, engine, offline):
    """``num_images_per_prompt=3`` offline, ``-n 3`` on the CLI and ``n=3`` over HTTP with seed 40
    give the same three images, and image i equals the one-image request with seed 40 + i."""
    steps, seed = 3, 40
    [out] = offline.generate("a red square", SamplingParams(num_inference_steps=steps, seed=seed,
                                                            num_images_per_prompt=3))
    offline_images = [np.asarray(image.convert("RGB")) for image in out.images]
    alone = [np.asarray(offline.generate("a red square", SamplingParams(num_inference_steps=steps, seed=seed + i))[0]
                        .images[0].convert("RGB")) for i in range(3)]
    assert main(["generate", "--model", str(tiny_sd3_dir), "a red square", "-n", "3", "--steps", str(steps),
                 "--seed", str(seed), "--threads", "1", "-o", str(tmp_path)]) == 0
    cli_files = sorted(p for p in tmp_path.glob("*.png") if not p.name.endswith("_raw.png"))
    assert [p.name.split("_seed")[1] for p in cli_files] == ["40.png", "41.png", "42.png"]
    cli_images = [np.asarray(Image.open(p).convert("RGB")) for p in cli_files]
    with serve(create_app(engine, "m")) as base:
        data = httpx.post(f"{base}/v1/images/generations", timeout=60, json={
            "prompt": "a red square", "n": 3, "seed": seed, "num_inference_steps": steps}).json()["data"]
    assert [d["seed"] for d in data] == [40, 41, 42]
    http_images = [_pixels(d["b64_json"]) for d in data]
    for i in range(3):
        for name, images in (("CLI", cli_images), ("HTTP", http_images), ("alone", alone)):
            # batched rows vs one row differ by float noise only (<= 1 level after 8-bit rounding)
            diff = np.abs(images[i].astype(int) - offline_images[i].astype(int)).max()
            assert diff <= 1, f"image {i}: offline vs {name} differ by {diff} levels"
    assert np.abs(offline_images[0].astype(int) - offline_images[1].astype(int)).max() > 10  # distinct images


def test_non_finite_outputs_are_counted_in_metrics(engine, monkeypatch):
    adapter = engine.engine.runner.adapter
    original = adapter.combine

    def poisoned(batch, out):
        guided = original(batch, out)
        for state, rows in zip(batch.states, batch.split(guided)):
            if "overflow" in state.prompt:
                rows.fill_(float("nan"))
        return guided

    monkeypatch.setattr(adapter, "combine", poisoned)
    with serve(create_app(engine, "m")) as base:
        metrics = httpx.get(f"{base}/metrics").text
        assert "diffserve_nonfinite_outputs_total 0.0" in metrics
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "fp16 overflow", "num_inference_steps": 2},
                          timeout=60)
        assert resp.status_code == 500 and "non-finite" in resp.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/images/generations", json={"prompt": "fine", "num_inference_steps": 2},
                          timeout=60).status_code == 200
        assert "diffserve_nonfinite_outputs_total 1.0" in httpx.get(f"{base}/metrics").text
