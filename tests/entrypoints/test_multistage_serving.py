"""Multi-stage models (an AR stage before the DiT) through the CLI and the HTTP server: the
built-in `digits-reasoning` (``diffserve generate --model digits-reasoning "three plus four"``
draws a 7 and prints the answer; HTTP ``revised_prompt``, ``diffserve.ar_delta`` SSE events
before the progress events, the stage metrics on ``/metrics``), and the tiny GLM-Image folder
equal to diffusers' `GlmImagePipeline` seed for seed (<= 1 uint8 level) offline, through the CLI
and over HTTP."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from diffserve import AsyncDiffusionEngine, DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.cli import main
from diffserve.entrypoints.openai.app import create_app

import quality  # benchmarks/quality.py (tests/conftest.py puts benchmarks/ on sys.path)
from server_helpers import serve, sse_events

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GLM_PROMPTS = ["A photo of a cat", "a sign that says 'hi'", "dog"]
GLM_SIZES = [(32, 32), (32, 32), (64, 32)]  # (height, width)


def judged(image) -> int:
    """The digit the project's judge reads in an 8x8 image (PIL, or uint8 / float array)."""
    pixels = np.asarray(image, dtype=np.float32)
    if pixels.max() > 1:
        pixels = pixels / 255.0
    if pixels.ndim == 3:
        pixels = pixels.mean(axis=-1)
    clf, _ = quality.build_judge()
    return int(quality.judge_images(clf, pixels[None])[0])


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


# ---------------------------------------------------------------------------- digits-reasoning
def test_cli_draws_the_answer_and_prints_it(tmp_path, capsys):
    rc = main(["generate", "--model", "digits-reasoning", "three plus four", "--seed", "0", "--threads", "1",
               "-o", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    [path] = out.split()
    assert "ar_text: seven" in err and "payload_wait=" in err
    assert judged(Image.open(path)) == 7


def test_http_revised_prompt_ar_delta_events_and_metrics():
    engine = AsyncDiffusionEngine(EngineConfig(model="digits-reasoning", num_threads=1))
    with serve(create_app(engine, "digits-reasoning")) as base:
        resp = httpx.post(f"{base}/v1/images/generations", timeout=120,
                          json={"prompt": "twice 4", "n": 2, "seed": 3, "size": "8x8"})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert [d["revised_prompt"] for d in data] == ["eight", "eight"]
        assert all(judged(decoded(d["b64_json"])) == 8 for d in data)
        assert data[0]["timings"]["payload_bytes"] > 0 and "payload_wait_s" in data[0]["timings"]
        with httpx.stream("POST", f"{base}/v1/images/generations", timeout=120,
                          json={"prompt": "the number before 6", "stream": True, "stream_progress": True}) as resp:
            assert resp.status_code == 200
            events = list(sse_events(resp))
        names = [name for name, _ in events if name != "diffserve.queued"]
        first_progress = names.index("diffserve.progress")
        assert "diffserve.ar_delta" in names and names.index("diffserve.ar_delta") < first_progress
        assert all(n != "diffserve.ar_delta" for n in names[first_progress:])
        text = "".join(d["delta"] for name, d in events if name == "diffserve.ar_delta")
        completed = events[-1][1]
        assert text == "five" and completed["type"] == "image_generation.completed"
        assert completed["revised_prompt"] == "five"
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert 'diffserve_ar_stage_requests_total{outcome="finished"} 3.0' in metrics
        assert 'diffserve_payloads_resident{unit="bytes"} 0.0' in metrics
        assert 'diffserve_request_stage_seconds_count{stage="payload_wait"} 3.0' in metrics
        assert "diffserve_payload_dedup_hits_total" in metrics


# ---------------------------------------------------------------------------- GLM-Image
@pytest.fixture(scope="module")
def glm_reference(tiny_glm_image_dir) -> list[np.ndarray]:
    """diffusers' `GlmImagePipeline` on the tiny folder: uint8 (H, W, 3) per prompt, seed 10 + i."""
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(tiny_glm_image_dir)
    pipe.set_progress_bar_config(disable=True)
    images = []
    for i, (prompt, (h, w)) in enumerate(zip(GLM_PROMPTS, GLM_SIZES)):
        out = pipe(prompt, height=h, width=w, num_inference_steps=4, generator=torch.Generator().manual_seed(10 + i),
                   output_type="np")
        images.append((out.images[0] * 255).round().astype(np.int16))
    return images


def assert_close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape and np.abs(got.astype(np.int16) - ref).max() <= 1


def test_glm_image_offline_equals_diffusers_seed_for_seed(tiny_glm_image_dir, glm_reference):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_glm_image_dir), num_threads=1))
    try:
        outputs = engine.generate(GLM_PROMPTS, [SamplingParams(seed=10 + i, height=h, width=w, num_inference_steps=4)
                                                for i, (h, w) in enumerate(GLM_SIZES)])  # sharing steps
    finally:
        engine.shutdown()
    for out, ref in zip(outputs, glm_reference):
        assert out.ok and out.ar_text is None and out.metrics.payload_bytes > 0
        assert_close(np.asarray(out.images[0].convert("RGB")), ref)


def test_glm_image_cli_and_http_equal_diffusers(tiny_glm_image_dir, glm_reference, tmp_path, capsys):
    h, w = GLM_SIZES[2]
    rc = main(["generate", "--model", str(tiny_glm_image_dir), GLM_PROMPTS[2], "--seed", "12", "--steps", "4",
               "--size", f"{w}x{h}", "--threads", "1", "-o", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert_close(np.asarray(Image.open(out.split()[0]).convert("RGB")), glm_reference[2])
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_glm_image_dir), num_threads=1))
    with serve(create_app(engine, "glm-image-tiny")) as base:
        resp = httpx.post(f"{base}/v1/images/generations", timeout=120,
                          json={"prompt": GLM_PROMPTS[0], "n": 2, "seed": 10, "size": "32x32",
                                "num_inference_steps": 4})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
    assert [d["revised_prompt"] for d in data] == [None, None]
    assert_close(decoded(data[0]["b64_json"]), glm_reference[0])
