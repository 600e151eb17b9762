"""One ``/metrics`` view over replicas (`ops.replica_metrics`), without Ray: two servers' metrics
published to one folder and merged, each series with its ``replica`` label and the sums as
``replica="all"``; a replica that stopped keeps its counters in the sums, not its gauges."""

from __future__ import annotations

import os
import time

from prometheus_client.parser import text_string_to_metric_families

from diffserve.entrypoints.openai.ops import replica_metrics
from diffserve.entrypoints.openai.ops.metrics import ServerMetrics
from diffserve.entrypoints.openai.ops.replica_metrics import ReplicaMetrics


def _samples(exposition: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(exposition.decode()) for s in family.samples}


def _key(name: str, **labels) -> tuple[str, tuple]:
    return name, tuple(sorted(labels.items()))


def test_merged_view_sums_every_replica_and_keeps_a_stopped_ones_counters(tmp_path):
    a, b = ServerMetrics(), ServerMetrics()
    view_a = ReplicaMetrics(tmp_path, "aaa", a.render)
    view_b = ReplicaMetrics(tmp_path, "bbb", b.render)
    a.observe_status(200), a.observe_status(200), b.observe_status(200), b.observe_status(429)
    a.observe_images(3)
    b.waiting.set(4)
    a.step_rows.observe(2), b.step_rows.observe(8)
    view_b.publish()
    merged = _samples(view_a.render()[0])  # a publishes itself, then reads both
    assert merged[_key("diffserve_requests_total", status="200", replica="aaa")] == 2
    assert merged[_key("diffserve_requests_total", status="200", replica="bbb")] == 1
    assert merged[_key("diffserve_requests_total", status="200", replica="all")] == 3
    assert merged[_key("diffserve_requests_total", status="429", replica="all")] == 1
    assert merged[_key("diffserve_images_generated_total", replica="all")] == 3
    assert merged[_key("diffserve_num_requests_waiting", replica="all")] == 4
    assert merged[_key("diffserve_step_batch_rows_count", replica="all")] == 2
    assert merged[_key("diffserve_step_batch_rows_bucket", le="2.0", replica="all")] == 1
    assert merged[_key("diffserve_step_batch_rows_sum", replica="all")] == 10
    assert not [k for k in merged if k[0].endswith("_created") and dict(k[1])["replica"] == "all"]
    # b stops (its file stays, growing old): its counters stay in the sums, its gauges leave them
    old = time.time() - replica_metrics.STALE_AFTER_S - 5
    os.utime(tmp_path / "bbb.prom", (old, old))
    a.observe_status(200)
    merged = _samples(view_a.render()[0])
    assert merged[_key("diffserve_requests_total", status="200", replica="all")] == 4
    assert merged[_key("diffserve_num_requests_waiting", replica="all")] == 0
    assert merged[_key("diffserve_num_requests_waiting", replica="bbb")] == 4  # still listed under its name


def test_published_every_interval_and_served_as_the_route_view(tmp_path, monkeypatch):
    monkeypatch.setattr(replica_metrics, "PUBLISH_INTERVAL_S", 0.05)
    metrics = ServerMetrics()
    view = ReplicaMetrics(tmp_path, "r1", metrics.render)
    metrics.set_view(view.render)
    view.start()
    try:
        metrics.observe_images(5)
        deadline = time.monotonic() + 5
        while b"diffserve_images_generated_total 5.0" not in (tmp_path / "r1.prom").read_bytes():
            assert time.monotonic() < deadline, "not republished"
            time.sleep(0.02)
        body, content_type = metrics.exposition()
        assert content_type.startswith("text/plain")
        assert _samples(body)[_key("diffserve_images_generated_total", replica="all")] == 5
    finally:
        view.stop()


def test_an_older_render_never_replaces_a_newer_one(tmp_path):
    """The publishing thread and a scrape publish concurrently: a publisher that rendered first
    and lost the CPU before its rename must not overwrite the newer file the other one wrote
    (CI once read a summed counter 40, then 38)."""
    import threading

    renders = iter(range(1, 100))
    first_rendered, first_may_write = threading.Event(), threading.Event()

    def render():
        value = next(renders)
        if value == 1:  # the slow publisher: rendered, then paused before its rename
            first_rendered.set()
            assert first_may_write.wait(10)
        return f"# TYPE x_total counter\nx_total {value}\n".encode(), "text/plain"

    metrics = ReplicaMetrics(tmp_path, "aaa", render)
    slow = threading.Thread(target=metrics.publish)
    slow.start()
    assert first_rendered.wait(10)
    fast = threading.Thread(target=metrics.publish)  # the scrape: renders 2
    fast.start()
    fast.join(0.3)  # unserialised, it would finish here and the slow one overwrite it with 1
    first_may_write.set()
    slow.join(10), fast.join(10)
    assert not slow.is_alive() and not fast.is_alive()
    assert (tmp_path / "aaa.prom").read_text().strip().endswith("x_total 2")
