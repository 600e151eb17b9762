"""The video streaming endpoints (`diffserve.entrypoints.openai.services.video_streams`), run for
real (uvicorn in a thread) on the tiny Wan folder: SSE chunks as MP4, interactions, errors,
disconnect = abort."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from diffserve import AsyncDiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.openai.app import create_app
from diffserve.media.video_encoding import decode_mp4
from server_helpers import assert_openai_error, serve, sse_events, wait_until

torch.set_num_threads(1)

STREAMS = "/v1/videos/streams"
BODY = {"prompt": "a cat surfing", "size": "48x32", "num_frames": 9, "num_inference_steps": 2, "seed": 3}


def counters(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics samples as {(name, sorted labels): value}."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def base(tiny_wan_dir):
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1,
                                               max_num_inference_steps=10_000))
    with serve(create_app(engine, "tiny-wan")) as url:
        yield url, engine


def test_stream_sends_chunks_as_mp4_and_takes_an_interaction(base):
    url, engine = base
    # chunks long enough to interact during: the interaction is posted when chunk 0 arrives and
    # must reach the engine before chunk 3 starts; 30 steps a chunk (~0.3 s here) was too short
    # a window on a loaded machine (the stream ended first: 409 stream_ended)
    steps = 150
    body = {**BODY, "num_chunks": 4, "num_inference_steps": steps}
    got, answers = [], []
    before = counters(url)
    with httpx.stream("POST", url + STREAMS, json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        stream_id = response.headers["x-request-id"]
        for name, data in sse_events(response):
            got.append((name, data))
            if name == "video.stream.chunk" and data["chunk_index"] == 0:
                answers.append(httpx.post(f"{url}{STREAMS}/{stream_id}/interactions",
                                          json={"prompt": "a dog running", "transition_chunks": 1,
                                                "event_id": "dog"}))
    names = [n for n, _ in got]
    assert names[0] == "video.stream.created" and names[-1] == "video.stream.completed"
    created = got[0][1]
    assert created["id"] == stream_id and created["num_chunks"] == 4 and created["size"] == "48x32"
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json() == {"object": "video.stream.interaction", "stream_id": stream_id, "event_id": "dog"}
    chunks = [d for n, d in got if n == "video.stream.chunk"]
    assert [c["chunk_index"] for c in chunks] == [0, 1, 2, 3]
    assert [c["num_frames"] for c in chunks] == [9, 8, 8, 8]
    assert [c["first_frame"] for c in chunks] == [0, 9, 17, 25]
    with_id = [c["chunk_index"] for c in chunks if c["event_ids"]]
    assert len(with_id) == 1 and with_id[0] >= 2 and chunks[with_id[0]]["event_ids"] == ["dog"]
    for c in chunks:
        frames, fps = decode_mp4(base64.b64decode(c["b64_data"]))
        assert frames.shape == (c["num_frames"], 32, 48, 3) and fps == created["fps"]
    progress = [d for n, d in got if n == "video.stream.progress"]
    assert len(progress) == 4 * steps and progress[-1] == {"type": "video.stream.progress", "id": stream_id,
                                                            "chunk_index": 3, "step": steps,
                                                            "num_inference_steps": steps}
    done = got[-1][1]
    video, _ = decode_mp4(base64.b64decode(done["b64_data"]))
    assert video.shape == (33, 32, 48, 3) and done["num_frames"] == 33 and done["seed"] == 3
    assert len(done["timings"]["chunk_s"]) == 4
    assert not engine.engine.has_unfinished_requests()
    after = counters(url)  # the stream is counted like any generation
    assert delta(before, after, "diffserve_requests_total", status="200") == 1
    assert delta(before, after, "diffserve_engine_requests_total", outcome="finished") == 1
    assert delta(before, after, "diffserve_videos_generated_total") == 1


def test_stream_routes_are_in_the_schema_of_a_streaming_model(base):
    url, _ = base
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    assert "post" in paths[STREAMS] and "post" in paths[STREAMS + "/{stream_id}/interactions"]


def test_stream_validation_errors(base):
    url, _ = base
    for extra, status, param in (({"num_chunks": 0}, 400, "num_chunks"), ({}, 400, "num_chunks"),
                                 ({"num_chunks": 2, "num_frames": 10}, 400, "num_frames"),
                                 ({"num_chunks": 2, "num_frames": 1}, 400, "num_frames"),  # no new frame per chunk
                                 ({"num_chunks": 2, "colour": "red"}, 400, "colour"),
                                 ({"num_chunks": 2, "size": "50x32"}, 400, "size"),
                                 ({"num_chunks": 2, "output_format": "avi"}, 400, "output_format"),
                                 ({"num_chunks": 2, "model": "other"}, 404, "model")):
        assert_openai_error(httpx.post(url + STREAMS, json={**BODY, **extra}), status, param)
    response = httpx.post(url + STREAMS, content=b"{}", headers={"content-type": "text/plain"})
    assert response.status_code == 415


def test_stream_takes_priority_and_deadline(base):
    """README: the bodies of images, edits, videos and video streams take ``priority`` and
    ``deadline_s``; a stream's reach the engine (queue delay by priority, SLO counted) and bad
    values are 400 naming the field."""
    url, _ = base
    for field, value in (("priority", 1.5), ("priority", "high"), ("priority", 2**31), ("priority", True),
                         ("deadline_s", 0), ("deadline_s", -1.0), ("deadline_s", "soon"), ("deadline_s", True),
                         ("deadline_s", 10**400)):
        assert_openai_error(httpx.post(url + STREAMS, json={**BODY, "num_chunks": 2, field: value}), 400, field)
    before = counters(url)
    body = {**BODY, "num_chunks": 2, "priority": -7, "deadline_s": 600}
    with httpx.stream("POST", url + STREAMS, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        names = [name for name, _ in sse_events(response)]
    assert names[-1] == "video.stream.completed"
    after = counters(url)
    assert ("diffserve_queue_delay_seconds_mean", (("priority", "-7"),)) in after
    assert delta(before, after, "diffserve_deadline_requests_total", met="true") == 1


def test_interaction_errors(base):
    url, engine = base
    assert_openai_error(httpx.post(f"{url}{STREAMS}/vstream-nope/interactions", json={"prompt": "a dog"}),
                        404, "stream_id", "stream_not_found")
    ordinary = engine.engine.add_request("a cat", SamplingParams(num_inference_steps=10_000, height=32, width=48,
                                                                 num_frames=9))
    try:
        assert_openai_error(httpx.post(f"{url}{STREAMS}/{ordinary}/interactions", json={"prompt": "a dog"}),
                            400, "stream_id", "not_a_stream")
    finally:
        engine.abort(ordinary)
    wait_until(lambda: not engine.engine.has_unfinished_requests(), what="abort")
    assert_openai_error(httpx.post(f"{url}{STREAMS}/{ordinary}/interactions", json={"prompt": "a dog"}),
                        409, "stream_id", "stream_ended")
    with httpx.stream("POST", url + STREAMS, json={**BODY, "num_chunks": 2, "num_inference_steps": 5000},
                      timeout=60) as response:
        stream_id = response.headers["x-request-id"]
        for extra, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "transition_chunks": -1}, "transition_chunks"),
                             ({"prompt": "x", "event_id": 3}, "event_id"), ({"prompt": "x", "when": 1}, "when")):
            assert_openai_error(httpx.post(f"{url}{STREAMS}/{stream_id}/interactions", json=extra), 400, param)
        # chunk 0 is denoising: the interaction applies to chunk 1, the last one
        answer = httpx.post(f"{url}{STREAMS}/{stream_id}/interactions", json={"prompt": "a dog"})
        assert answer.status_code == 200 and len(answer.json()["event_id"]) == 32
    wait_until(lambda: not engine.engine.has_unfinished_requests(), what="abort on close")


def test_disconnect_aborts_the_stream(base):
    url, engine = base
    before = counters(url)
    with httpx.stream("POST", url + STREAMS, json={**BODY, "num_chunks": 50, "num_inference_steps": 4},
                      timeout=60) as response:
        for name, data in sse_events(response):
            if name == "video.stream.chunk":
                break
    wait_until(lambda: not engine.engine.has_unfinished_requests(), timeout=10, what="abort after disconnect")
    wait_until(lambda: delta(before, counters(url), "diffserve_engine_requests_total", outcome="aborted") == 1,
               what="the aborted stream counted")
    time.sleep(0.3)
    assert delta(before, counters(url), "diffserve_engine_requests_total", outcome="aborted") == 1  # once


def test_image_model_refuses_streams(tiny_sd3_dir):
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), num_threads=1))
    with serve(create_app(engine, "tiny-sd3")) as url:
        assert_openai_error(httpx.post(url + STREAMS, json={"prompt": "a cat", "num_chunks": 2}), 404,
                            None, "unsupported_endpoint")
        assert not any(path.startswith(STREAMS) for path in httpx.get(url + "/openapi.json").json()["paths"])


def test_a_lora_that_fails_to_load_is_a_400_event_and_an_invalid_job(tiny_wan_dir, tmp_path):
    """A ``--lora-dir`` file that is no LoRA is found only when it loads, after the request was
    queued: the stream ends with an ``error`` event of status 400 naming ``loras`` (not a 500
    ``generation_failed``), and a ``/v1/videos`` job fails with ``invalid_value``."""
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1, lora_dir=str(tmp_path)))
    with serve(create_app(engine, "tiny-wan")) as url:
        body = {**BODY, "num_chunks": 2, "loras": {"broken": 1.0}}
        with httpx.stream("POST", url + STREAMS, json=body, timeout=60) as response:
            events = list(sse_events(response))
        name, data = events[-1]
        assert name == "error" and data["error"]["param"] == "loras", events
        assert data["error"]["code"] == "invalid_value" and data["error"]["type"] == "invalid_request_error"
        job = httpx.post(url + "/v1/videos", json={**BODY, "loras": {"broken": 1.0}}, timeout=60).json()
        status = lambda: httpx.get(f"{url}/v1/videos/{job['id']}").json()  # noqa: E731
        wait_until(lambda: status()["status"] == "failed", 30, "the job to fail")
        assert status()["error"]["code"] == "invalid_value"
