"""Replicas on Ray Serve (`diffserve.entrypoints.ray_serve`): a real local Ray cluster (one per
module, 2 CPUs) and the real ``diffserve serve --replicas 2 --ray-address ...`` CLI in a
subprocess, serving the built-in digits model with 1 torch thread per replica.

Which replica served a request is read from the ``X-Diffserve-Replica`` response header."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from diffserve.entrypoints.openai.stores.image_store import ImageStore
from diffserve.entrypoints.ray_serve import APP_NAME, REPLICA_HEADER, build_app, parse_serve_options
from diffserve.core.errors import InvalidRequestError

REPO = Path(__file__).resolve().parents[2]
PROMPT = "a handwritten digit 3"
MAX_BATCH_SIZE = 8  # rows; so max_ongoing_requests = 8 per replica


@dataclass
class Replicas:
    base: str
    store_dir: Path
    process: subprocess.Popen
    log: Path

    @property
    def generations(self) -> str:
        return f"{self.base}/v1/images/generations"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """A local Ray cluster, and ``diffserve serve --replicas 2`` deployed on it by the CLI."""
    work = tmp_path_factory.mktemp("ray")
    usage_stats = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # Ray reports nothing anywhere (cluster and CLI inherit it)
    start = time.monotonic()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    ray_up = time.monotonic()
    port = _free_port()
    log = work / "serve.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "diffserve", "serve", "--replicas", "2", "--ray-address",
         ray.get_runtime_context().gcs_address, "--port", str(port), "--threads", "1",
         "--max-batch-size", str(MAX_BATCH_SIZE), "--image-store-dir", str(work / "images"),
         "--shutdown-timeout", "5"],
        cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            assert process.poll() is None, f"diffserve serve exited {process.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"replicas not up after 240 s:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"\nray.init {ray_up - start:.1f}s, then replicas healthy after {time.monotonic() - ray_up:.1f}s")
        yield Replicas(base, work / "images", process, log)
        process.send_signal(signal.SIGTERM)  # the CLI deletes the application and exits 0
        assert process.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        serve.shutdown()
        ray.shutdown()
        if usage_stats is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = usage_stats


def _generate(replicas: Replicas, client: httpx.Client, seed: int, **fields) -> httpx.Response:
    body = {"prompt": PROMPT, "seed": seed, "num_inference_steps": 20, **fields}
    return client.post(replicas.generations, json=body)


def _pixels(response: httpx.Response) -> tuple[bytes, np.ndarray]:
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    return png, np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def test_40_concurrent_requests_use_both_replicas_and_same_seed_gives_same_image(replicas):
    seeds = [i % 4 for i in range(40)]  # every seed 10 times
    with httpx.Client(timeout=180) as client, ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(lambda seed: _generate(replicas, client, seed), seeds))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = Counter(r.headers[REPLICA_HEADER] for r in responses)
    # at most max_ongoing_requests = 8 per replica at once: 40 requests cannot all go to one
    assert len(served) == 2 and min(served.values()) > 0, served
    identical = cross_replica = 0
    for seed in range(4):
        group = [(r.headers[REPLICA_HEADER], *_pixels(r)) for r, s in zip(responses, seeds) if s == seed]
        reference_replica, reference_png, reference = group[0]
        for replica, png, pixels in group[1:]:
            # batches differ between replicas and over time (float sums in another order, ~1e-6):
            # 8-bit pixels may round one level apart, never more
            assert np.abs(pixels - reference).max() <= 1, seed
            identical += png == reference_png
            cross_replica += replica != reference_replica
    print(f"\n40 concurrent: served {dict(served)}; {identical}/36 images byte-identical to the first of their "
          f"seed ({cross_replica} compared across replicas), the rest within one 8-bit level")


def _scrape(client: httpx.Client, replicas: Replicas) -> tuple[str, dict[tuple[str, tuple], float]]:
    """One scrape of the public ``/metrics``: (the replica that answered, {(sample, labels): value})."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get(f"{replicas.base}/metrics")
    assert response.status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    return response.headers[REPLICA_HEADER], samples


def _total(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({**labels, "replica": "all"}.items()))), 0.0)


def test_metrics_report_every_replica_summed(replicas):
    """``/metrics`` through the public port answers for every replica, whichever serves the
    scrape: each replica's series with its ``replica`` label and their sum as ``replica="all"``;
    the sums never go backwards from one scrape to the next (they read 28, 25, 28 when the
    answering replica reported only its own)."""
    name = "diffserve_engine_requests_total"
    seen_answering, previous = set(), 0.0
    with httpx.Client(timeout=120) as client:
        for round_ in range(12):
            if round_ % 3 == 0:
                assert _generate(replicas, client, round_).status_code == 200
            answered_by, samples = _scrape(client, replicas)
            seen_answering.add(answered_by)
            ids = {dict(labels)["replica"] for (sample, labels) in samples if sample == name}
            assert len(ids - {"all"}) >= 2 and "all" in ids, ids
            per_replica = sum(v for (sample, labels), v in samples.items()
                              if sample == name and dict(labels).get("outcome") == "finished"
                              and dict(labels)["replica"] != "all")
            total = _total(samples, name, outcome="finished")
            assert total == per_replica and total >= previous, (round_, total, per_replica, previous)
            previous = total
    assert previous >= 40  # the 40 concurrent requests above, counted on both replicas
    print(f"\n/metrics: answered by {sorted(seen_answering)}; finished engine requests (all) {previous:g}")


def test_same_seed_alone_gives_identical_bytes_on_every_replica(replicas):
    """One request at a time: every run is a batch of one, whichever replica serves it, so the
    float computation is the same and so are the PNG bytes."""
    pngs: dict[str, bytes] = {}
    seen = Counter()
    with httpx.Client(timeout=60) as client:
        for _ in range(30):  # routing is random among idle replicas: both serve within a few tries
            response = _generate(replicas, client, 11)
            assert response.status_code == 200, response.text
            replica = response.headers[REPLICA_HEADER]
            seen[replica] += 1
            png, _ = _pixels(response)
            assert pngs.setdefault(replica, png) == png
            if len(pngs) == 2:
                break
    assert len(pngs) == 2, seen
    assert len(set(pngs.values())) == 1


def _download_from_another_replica(client: httpx.Client, url: str, writer: str) -> httpx.Response:
    for _ in range(30):
        response = client.get(url)
        assert response.status_code == 200, response.text
        if response.headers[REPLICA_HEADER] != writer:
            return response
    raise AssertionError(f"{url} was always served by its writer {writer}")


def test_url_links_are_served_by_every_replica(replicas):
    with httpx.Client(timeout=60) as client:
        response = _generate(replicas, client, 5, response_format="url")
        assert response.status_code == 200, response.text
        writer = response.headers[REPLICA_HEADER]
        url = response.json()["data"][0]["url"]
        assert url.startswith(f"{replicas.base}/v1/images/files/")
        name = url.rsplit("/", 1)[1]
        assert (replicas.store_dir / name).is_file()  # the shared folder, not a replica's memory
        download = _download_from_another_replica(client, url, writer)
        assert download.headers["content-type"] == "image/png"
        assert download.content == (replicas.store_dir / name).read_bytes()
        assert Image.open(io.BytesIO(download.content)).size == (8, 8)
        b64 = _generate(replicas, client, 5)  # the same image as b64_json
        assert _pixels(b64)[0] == download.content


def _stream(replicas: Replicas, seed: int, started: threading.Event, outcome: dict) -> None:
    """A streaming request with step progress: records its replica, sets `started` at its
    first denoising step, then how it ended."""
    body = {"prompt": PROMPT, "seed": seed, "num_inference_steps": 100, "stream": True, "stream_progress": True}
    try:
        with httpx.stream("POST", replicas.generations, json=body, timeout=120) as response:
            outcome["status"] = response.status_code
            outcome["replica"] = response.headers.get(REPLICA_HEADER)
            event = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[len("event: "):]
                elif line.startswith("data: ") and event == "diffserve.progress" and json.loads(line[6:])["step"] >= 1:
                    started.set()
                elif line.startswith("data: ") and event == "image_generation.completed":
                    outcome["completed"] = True
    except httpx.HTTPError as exc:  # the connection to the proxy ends
        outcome["error"] = repr(exc)
    finally:
        outcome.setdefault("completed", False)


def _links_by_replica(replicas: Replicas) -> dict[str, str]:
    """A ``url`` link written by each replica."""
    links: dict[str, str] = {}
    with httpx.Client(timeout=60) as client:
        for seed in range(30):
            response = _generate(replicas, client, seed, response_format="url")
            assert response.status_code == 200, response.text
            links.setdefault(response.headers[REPLICA_HEADER], response.json()["data"][0]["url"])
            if len(links) == 2:
                return links
    raise AssertionError(f"one replica served every request: {links}")


def test_killing_a_replica_mid_load(replicas):
    """Requests in flight on a killed replica end at once with an error (Ray's proxy answers
    500, or cuts the stream); queued requests, new requests and the dead replica's url links
    are served by the other replica. Runs last: it kills a replica."""
    links = _links_by_replica(replicas)
    streams = [(threading.Event(), {}) for _ in range(8)]
    plain: list[httpx.Response | Exception] = []

    def post(seed: int) -> None:
        try:
            with httpx.Client(timeout=120) as client:
                plain.append(_generate(replicas, client, seed, num_inference_steps=100))
        except httpx.HTTPError as exc:
            plain.append(exc)

    threads = [threading.Thread(target=_stream, args=(replicas, 100 + i, *s)) for i, s in enumerate(streams)]
    threads += [threading.Thread(target=post, args=(200 + i,)) for i in range(8)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not (running := [o for event, o in streams if event.is_set()]):
        assert time.monotonic() < deadline, [o for _, o in streams]
        time.sleep(0.02)
    victim = running[0]["replica"]  # a replica with a request surely in flight
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{APP_NAME}#{victim}", namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=150)
    assert not any(thread.is_alive() for thread in threads), "a request hangs"
    outcomes = [outcome for _, outcome in streams]
    interrupted = [o for o in outcomes if o["replica"] == victim and not o["completed"]]
    assert interrupted, outcomes  # in flight on the victim when it died: ended without images
    for outcome in outcomes:
        if outcome["status"] == 500:  # on the victim before its response began: Ray's proxy answers 500
            assert outcome["replica"] is None and not outcome["completed"], outcome
            continue
        assert outcome["status"] == 200, outcome
        if outcome["replica"] != victim:
            assert outcome["completed"], outcome  # the other replica finished its streams
    statuses = Counter(r.status_code if isinstance(r, httpx.Response) else "cut" for r in plain)
    assert set(statuses) <= {200, 500}, statuses  # 500: Ray's proxy for a request on the dead replica
    for response in plain:
        if response.status_code == 500:
            assert response.text == "Internal Server Error"
        else:
            assert response.json()["data"][0]["b64_json"] and response.headers[REPLICA_HEADER]
    print(f"\nkill mid-load: {len(interrupted)} stream(s) cut on the victim, plain requests {dict(statuses)}, "
          f"killed {killed_at - start:.1f}s after the load began, all answered {time.monotonic() - start:.1f}s after")
    with httpx.Client(timeout=60) as client:
        for seed in range(4):  # the survivor (or Ray's replacement) keeps serving
            response = _generate(replicas, client, seed)
            assert response.status_code == 200 and response.headers[REPLICA_HEADER] != victim
        download = client.get(links[victim])  # the dead replica's link, from the shared folder
        assert download.status_code == 200 and download.headers[REPLICA_HEADER] != victim
        assert Image.open(io.BytesIO(download.content)).size == (8, 8)
        # the dead replica's counters stay in the sums (its last published values): no summed
        # counter goes backwards when a replica goes away
        _, samples = _scrape(client, replicas)
        victims = {labels: v for (sample, labels), v in samples.items()
                   if sample == "diffserve_requests_total" and dict(labels)["replica"] == victim}
        assert victims and sum(victims.values()) > 0
        assert _total(samples, "diffserve_requests_total", status="200") >= \
            sum(v for labels, v in victims.items() if dict(labels)["status"] == "200")


# ------------------------------------------------------------------ without a running cluster
def test_serve_run_config_file_is_valid_for_ray_serve():
    """``deploy/ray_serve.yaml`` is a valid Ray Serve config whose import path is `build_app`."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema(**yaml.safe_load((REPO / "deploy" / "ray_serve.yaml").read_text()))
    [app] = config.applications
    assert app.import_path == "diffserve.entrypoints.ray_serve:build_app"
    args = parse_serve_options(app.args)
    assert args.replicas >= 1 and args.image_store_dir


def test_build_app_checks_options_like_the_cli():
    with pytest.raises(InvalidRequestError, match="image_store_dir"):
        build_app({"replicas": 2})
    with pytest.raises(InvalidRequestError, match="replicas"):
        build_app({"replicas": 0, "image_store_dir": "/tmp/x"})
    with pytest.raises(InvalidRequestError, match="autoscaling_config.*max_replicas"):
        build_app({"replicas": 1, "image-store-dir": "/tmp/x",
                   "autoscaling_config": json.dumps({"min_replicas": 2, "max_replicas": 1})})
    with pytest.raises(InvalidRequestError, match="autoscaling_config"):
        build_app({"replicas": 1, "image-store-dir": "/tmp/x", "autoscaling_config": '{"max_replica": 3}'})


@pytest.mark.parametrize("argv, message", [
    (["--ray-address", "auto"], "argument --ray-address: invalid value 'auto': must be used with --replicas N"),
    (["--replicas", "0"], "argument --replicas: invalid value 0: must be an integer >= 1"),
    (["--replicas", "2", "--port", "0"], "argument --port: invalid value 0: must be an integer in [1, 65535] with "
                                          "--replicas"),
    (["--replicas", "2", "--ray-address", "auto"], "argument --image-store-dir: invalid value None: must be a "
                                                    "folder on storage every node of the Ray cluster mounts"),
    (["--replicas", "2", "--autoscaling-config", "{min_replicas: 1}"], "argument --autoscaling-config: invalid "
                                                                        "value '{min_replicas: 1}': must be a JSON object"),
    (["--replicas", "2", "--ray-actor-options", "[]"], "argument --ray-actor-options: invalid value '[]': must be "
                                                       "a JSON object"),
])
def test_cli_refuses_bad_replica_options_before_starting_ray(argv, message, capsys):
    from diffserve.entrypoints.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"diffserve: error: {message}") and err.count("\n") == 1, err


def test_shared_image_store_serves_links_of_other_writers_until_they_expire(tmp_path):
    now = [1000.0]
    writer = ImageStore(ttl_s=10, spill_dir=tmp_path, shared=True, wall_clock=lambda: now[0], clock=lambda: now[0])
    reader = ImageStore(ttl_s=10, spill_dir=tmp_path, shared=True, wall_clock=lambda: now[0], clock=lambda: now[0])
    name, _ = writer.put(b"png-bytes", "image/png", "png", writer.reserve(1, 100))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # written at once, no temporary left
    got = reader.get(name)
    assert got.data == b"png-bytes" and got.media_type == "image/png" and got.expires_at == 1010.0
    assert reader.get("../" + name) is None and reader.get("unknown.png") is None
    writer.close()  # a writer that stops breaks no promise
    assert reader.get(name).data == b"png-bytes"
    now[0] = 1010.0
    assert reader.get(name) is None  # expired, and swept from the folder by the reader
    assert not list(tmp_path.iterdir())


def test_replicas_share_one_video_job_folder(tmp_path):
    """Every replica's video store is the same folder: --video-store-dir, else the url image
    folder's ``videos`` subfolder (what one replica creates, any replica reads)."""
    from diffserve.entrypoints.ray_serve import shared_video_store_dir

    images = str(tmp_path / "images")
    args = parse_serve_options({"image-store-dir": images})
    assert shared_video_store_dir(args) == os.path.join(images, "videos")
    args = parse_serve_options({"image-store-dir": images, "video-store-dir": str(tmp_path / "jobs")})
    assert shared_video_store_dir(args) == str(tmp_path / "jobs")
