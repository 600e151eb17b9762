"""OpenAI's Videos API (``POST /v1/videos`` ...) on a tiny Wan 2.1 folder, run for real and
driven by the official ``openai`` client (``client.videos.create / retrieve / download_content /
delete / list``) and raw HTTP; a second replica sharing the job folder."""

from __future__ import annotations

import io
import json
import re
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from diffserve import AsyncDiffusionEngine, DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.openai.app import create_app
from diffserve.entrypoints.openai.services.videos import frames_for_seconds
from diffserve.entrypoints.openai.stores.video_store import LocalVideoStore
from diffserve.media.video_encoding import decode_mp4, read_mp4_metadata
from server_helpers import assert_openai_error, serve, wait_until

torch.set_num_threads(1)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the Videos API deprecated

MODEL = "tiny-wan"
FAST = {"num_frames": 9, "num_inference_steps": 2}  # with size 48x32: 3 latent frames of 4x6
LONG_STEPS = 20_000


@pytest.fixture(scope="module")
def server(tiny_wan_dir, tmp_path_factory):
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1,
                                               max_num_inference_steps=LONG_STEPS))
    folder = tmp_path_factory.mktemp("videos")
    with serve(create_app(engine, MODEL, video_store=LocalVideoStore(folder, ttl_s=600))) as base:
        yield SimpleNamespace(base=base, engine=engine, folder=folder,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0))


def poll(client, video, timeout=60.0):
    """Retrieve `video` until it ended; returns (final video, progress values seen)."""
    seen = [video.progress]
    deadline = time.monotonic() + timeout
    while video.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"video job did not end: {video}"
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
        seen.append(video.progress)
    return video, seen


def test_create_poll_download_with_the_openai_client(server, tiny_wan_dir):
    video = server.client.videos.create(prompt="a cat surfing", size="48x32", extra_body={**FAST, "seed": 7})
    assert video.status == "queued" and video.id.startswith("video_") and video.model == MODEL
    assert (video.size, video.seconds, video.num_frames, video.fps) == ("48x32", "0.5625", 9, 16)
    assert video.expires_at is None and video.progress == 0
    video, seen = poll(server.client, video)
    assert video.status == "completed" and video.progress == 100 and seen == sorted(seen)
    assert video.steps_done == video.num_inference_steps == 2 and video.timings["num_steps"] == 2
    assert video.completed_at >= video.created_at and video.expires_at == pytest.approx(video.completed_at + 600, abs=1)
    data = server.client.videos.download_content(video.id).read()
    frames, fps = decode_mp4(data)
    assert frames.shape == (9, 32, 48, 3) and fps == 16
    tags = json.loads(read_mp4_metadata(data)["diffserve"])
    assert (tags["prompt"], tags["seed"], tags["num_frames"], tags["model"]) == ("a cat surfing", 7, 9, MODEL)
    # the frames are the offline engine's for the same request (through H.264 at crf 18)
    offline = DiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1))
    [out] = offline.generate("a cat surfing", SamplingParams(height=32, width=48, seed=7, output_type="np", **FAST))
    assert np.abs(frames.astype(np.int16) - out.videos[0].astype(np.int16)).mean() < 4
    raw = httpx.get(f"{server.base}/v1/videos/{video.id}/content")
    assert raw.headers["content-type"] == "video/mp4" and raw.content == data


def test_seconds_become_frames_the_model_allows(server):
    assert frames_for_seconds(4, 16, 4) == 65 and frames_for_seconds(1, 8, 4) == 9
    assert frames_for_seconds(0.01, 16, 4) == 1 and frames_for_seconds(2, 10, 1) == 20
    video = server.client.videos.create(prompt="a dog", seconds="1", size="48x32",  # at the model's 16 fps
                                        extra_body={"num_inference_steps": 1})
    assert (video.num_frames, video.fps, video.seconds) == (17, 16, "1.0625")
    video, _ = poll(server.client, video)
    assert video.status == "completed"
    assert decode_mp4(server.client.videos.download_content(video.id).read())[0].shape[0] == 17
    # a JSON number may have a fraction; the served schema states the model's range
    resp = httpx.post(f"{server.base}/v1/videos", json={"prompt": "a dog", "seconds": 0.5, "size": "48x32",
                                                       "num_inference_steps": 1})
    assert resp.json()["num_frames"] == 9
    spec = httpx.get(f"{server.base}/openapi.json").json()
    seconds = spec["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]["seconds"]["anyOf"]
    longest = server.engine.engine.spec.max_num_frames / 16
    assert seconds[1] == {"type": "number", "exclusiveMinimum": 0, "maximum": longest}
    assert re.fullmatch(seconds[0]["pattern"], str(int(longest))) and not re.fullmatch(seconds[0]["pattern"],
                                                                                      str(int(longest) + 1))


def test_json_body_and_errors_name_the_field(server):
    url = f"{server.base}/v1/videos"
    ok = httpx.post(url, json={"prompt": "a bird", "size": "48x32", **FAST})
    assert ok.status_code == 200 and ok.json()["status"] in ("queued", "in_progress")
    cases = [
        ({"size": "40x32"}, 400, "size"),
        ({"num_frames": 8}, 400, "num_frames"),
        ({"seconds": "4", "num_frames": 9}, 400, "seconds"),
        ({"seconds": "soon"}, 400, "seconds"),
        ({"seconds": "2.5"}, 400, "seconds"),  # as text: whole seconds (OpenAI's form); a JSON number may be 2.5
        ({"seconds": "1000"}, 400, "seconds"),  # more frames than the model's positions allow
        ({"seconds": "1", "fps": 8}, 400, "fps"),  # seconds count at the model's fps
        ({"true_cfg_scale": 2.0}, 400, "true_cfg_scale"),
        ({"n": 2}, 400, "n"),
        ({"model": "sora-2"}, 404, "model"),
        ({"prompt": "  "}, 400, "prompt"),
        ({"deadline_s": 10**400}, 400, "deadline_s"),  # too large for a float: not a 500
        ({"priority": 2.5}, 400, "priority"),
    ]
    for fields, status, param in cases:
        resp = httpx.post(url, json={"prompt": "a bird", "size": "48x32", "num_inference_steps": 1, **fields})
        assert_openai_error(resp, status, param=param)
    form = httpx.post(url, data={"prompt": "x"}, files={"input_reference": ("r.png", b"png", "image/png")})
    assert_openai_error(form, 400, param="input_reference")
    assert_openai_error(httpx.post(url, content=b"prompt=x", headers={"content-type": "text/plain"}), 415)
    for path in ("/v1/videos/video_nope", "/v1/videos/video_nope/content"):
        assert_openai_error(httpx.get(server.base + path), 404, param="video_id")
    assert_openai_error(httpx.delete(server.base + "/v1/videos/not-a-video-id"), 404, param="video_id")
    assert_openai_error(httpx.get(url, params={"limit": "0"}), 400, param="limit")
    assert_openai_error(httpx.get(url, params={"order": "up"}), 400, param="order")
    with pytest.raises(openai.NotFoundError):
        server.client.videos.retrieve("video_" + "0" * 32)


def test_delete_aborts_a_running_job_and_deletes_a_finished_one(server):
    running = server.client.videos.create(prompt="a long one", size="48x32",
                                          extra_body={"num_frames": 9, "num_inference_steps": LONG_STEPS})
    wait_until(lambda: server.client.videos.retrieve(running.id).steps_done > 0, timeout=30, what="steps")
    with pytest.raises(openai.ConflictError, match="in progress"):
        server.client.videos.download_content(running.id)
    assert server.client.videos.delete(running.id).deleted
    wait_until(lambda: not server.engine.engine.has_unfinished_requests(), timeout=10, what="abort")
    with pytest.raises(openai.NotFoundError):
        server.client.videos.retrieve(running.id)
    done, _ = poll(server.client, server.client.videos.create(prompt="short", size="48x32", extra_body=FAST))
    assert server.client.videos.delete(done.id).id == done.id
    assert not list(server.folder.glob(f"{done.id}*"))
    with pytest.raises(openai.NotFoundError):
        server.client.videos.delete(done.id)


def test_a_job_deleted_through_another_replica_is_aborted(server):
    """A second replica sharing the job folder deletes a job this server runs: this server aborts
    it within its tick."""
    other_replica = LocalVideoStore(server.folder)
    running = server.client.videos.create(prompt="elsewhere", size="48x32",
                                          extra_body={"num_frames": 9, "num_inference_steps": LONG_STEPS})
    assert other_replica.get(running.id).owner != other_replica.replica
    wait_until(lambda: other_replica.get(running.id).status == "in_progress", timeout=30, what="start")
    other_replica.delete(running.id)
    wait_until(lambda: not server.engine.engine.has_unfinished_requests(), timeout=10, what="abort")


def test_list_pages_with_the_openai_client(server):
    ids = [server.client.videos.create(prompt=f"clip {i}", size="48x32", extra_body=FAST).id for i in range(3)]
    for video_id in ids:
        poll(server.client, server.client.videos.retrieve(video_id))
    page = server.client.videos.list(limit=2)
    assert [v.id for v in page.data] == ids[::-1][:2] and page.has_more
    every = [v.id for v in server.client.videos.list(limit=2)]  # the client follows last_id -> after
    assert every[:3] == ids[::-1] and every == sorted(every, reverse=True)
    oldest_first = [v.id for v in server.client.videos.list(order="asc", limit=100)]
    assert oldest_first == every[::-1]
    # a cursor that is no video id is refused; a well-formed one still works after its job is gone
    with pytest.raises(openai.BadRequestError, match="after.*pattern"):
        server.client.videos.list(after="nope")
    server.client.videos.delete(ids[1])
    after_gone = server.client.videos.list(after=ids[1], limit=100)
    assert [v.id for v in after_gone.data][:1] == [ids[0]]


def test_full_store_refuses_before_compute_and_image_routes_refuse_video_models(tiny_wan_dir, tmp_path):
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1))
    with serve(create_app(engine, MODEL, video_store_dir=tmp_path, max_video_jobs=1)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        first, _ = poll(client, client.videos.create(prompt="one", size="48x32", extra_body=FAST))
        resp = httpx.post(f"{base}/v1/videos", json={"prompt": "two", "size": "48x32", **FAST})
        assert_openai_error(resp, 503, code="video_store_full")
        assert 590 <= int(resp.headers["retry-after"]) <= 3600  # until the first job expires
        assert client.videos.retrieve(first.id).status == "completed"  # its promise holds
        card = httpx.get(f"{base}/v1/models/{MODEL}").json()
        assert card["capabilities"] == ["text-to-video"] and {"num_frames", "fps"} <= set(card["parameters"])
        assert not {"n", "partial_images", "strength"} & set(card["parameters"])  # /v1/videos takes none of them
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"})
        assert_openai_error(resp, 404, code="unsupported_endpoint")  # not served, nor in the schema
        assert "POST /v1/videos" in resp.json()["error"]["message"]
        png = io.BytesIO()
        Image.new("RGB", (48, 32)).save(png, format="PNG")
        resp = httpx.post(f"{base}/v1/images/edits", data={"prompt": "x"},
                          files={"image": ("x.png", png.getvalue(), "image/png")})
        assert_openai_error(resp, 404, code="unsupported_endpoint")
        assert not {"/v1/images/generations", "/v1/images/edits"} & set(httpx.get(f"{base}/openapi.json").json()["paths"])
    assert len(list(tmp_path.glob("video_*.json"))) == 1  # a folder given by the user stays


def test_queued_jobs_report_their_queue_position(tiny_wan_dir, tmp_path):
    """A job waiting for admission reports its 1-based place in the engine's waiting queue on
    every poll (the store holds it from creation on), and null once it runs."""
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1, max_num_inference_steps=LONG_STEPS,
                                               max_batch_size=2))  # one CFG request at a time
    with serve(create_app(engine, MODEL, video_store=LocalVideoStore(tmp_path, ttl_s=600))) as base:
        job = {"size": "48x32", "num_frames": 9}
        running = httpx.post(f"{base}/v1/videos", json={**job, "prompt": "a", "num_inference_steps": LONG_STEPS}).json()
        wait_until(lambda: engine.num_running == 1, what="the first job running")
        waiting = [httpx.post(f"{base}/v1/videos", json={**job, "prompt": p, "num_inference_steps": 2}).json()
                   for p in ("b", "c")]
        assert [w["queue_position"] for w in waiting] == [1, 2]
        for _ in range(4):  # polls right away and across the jobs' clock ticks
            polled = [httpx.get(f"{base}/v1/videos/{w['id']}").json() for w in waiting]
            assert [(p["status"], p["queue_position"]) for p in polled] == [("queued", 1), ("queued", 2)]
            time.sleep(0.2)
        assert httpx.get(f"{base}/v1/videos/{running['id']}").json()["queue_position"] is None
        httpx.delete(f"{base}/v1/videos/{running['id']}")
        for w in waiting:
            wait_until(lambda: httpx.get(f"{base}/v1/videos/{w['id']}").json()["status"] == "completed", timeout=60,
                       what="the queued job completed")
            assert httpx.get(f"{base}/v1/videos/{w['id']}").json()["queue_position"] is None
