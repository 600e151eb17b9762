"""One ``/metrics`` view over every replica (``diffserve serve --replicas N``).

Behind Ray Serve the public port hands each scrape to one replica of its choice, so a replica
answering with its own counters made a counter read 28, 25, 28 across scrapes. Instead, every
replica publishes its exposition (`ServerMetrics.render`) to a folder all replicas share (a
subfolder of the url image folder, on storage every node mounts), once a second and before it
answers a scrape, and answers ``/metrics`` with all of them merged:

- every series of every replica, with a ``replica`` label (Ray Serve's replica id, as in the
  ``X-Diffserve-Replica`` header);
- the sum over the replicas with ``replica="all"``: counters and histograms (buckets, counts,
  sums) over every replica that ever published, including stopped or dead ones (their last
  values), so no summed counter goes backwards when a replica goes away; gauges over the
  replicas that published in the last `STALE_AFTER_S` seconds (a dead replica's running
  requests are not running). Sum with ``replica!="all"`` in PromQL, or read ``replica="all"``.

A replica writes its own file before it reads the others', so whichever replica answers the
next scrape reads values at least as new: counters read through the public port never go
backwards (tests/entrypoints/test_ray_serve.py). Within a replica, the publishing thread and a
scrape both publish; one lock holds each render together with its rename, so a render taken
earlier never replaces a newer one (an unlocked publisher rendered, lost the CPU, and then
overwrote the scrape's newer file: a summed counter read 40 and then 38).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

#: Seconds between a replica's publications.
PUBLISH_INTERVAL_S = 1.0
#: A replica whose file is older than this no longer counts in the summed gauges.
STALE_AFTER_S = 10.0
#: The ``replica`` label value of the sums.
ALL = "all"
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")


class ReplicaMetrics:
    """Publishes one replica's metrics to `folder` and merges every replica's (see the module
    docstring).

    Args:
        folder: the folder all replicas share (created if missing).
        replica_id: this replica's id (the ``replica`` label).
        render: ``() -> (exposition bytes, content type)`` of this replica's own metrics.
    """

    def __init__(self, folder: str | os.PathLike, replica_id: str, render: Callable[[], tuple[bytes, str]]):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.replica_id = replica_id
        self._render = render
        self._path = self.folder / f"{_SAFE_ID.sub('_', replica_id)}.prom"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publishing = threading.Lock()  # a render and its rename, as one step

    def publish(self) -> None:
        """Write this replica's exposition to its file (atomic rename). Publications are
        serialised, so the file only ever moves to a newer render."""
        with self._publishing:
            body, _ = self._render()
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".prom")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(body)
                os.replace(tmp, self._path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def start(self) -> None:
        """Publish now and then every `PUBLISH_INTERVAL_S` seconds on a daemon thread."""
        self.publish()
        self._thread = threading.Thread(target=self._run, name="diffserve-replica-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing (the last file stays: its counters keep counting in the sums)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the next round retries; a scrape publishes too
                logger.warning("could not publish this replica's metrics to %s", self.folder, exc_info=True)

    def render(self) -> tuple[bytes, str]:
        """Publish this replica's metrics, then every replica's merged (exposition bytes and
        its content type)."""
        self.publish()
        now = time.time()
        published: list[tuple[str, str, bool]] = []  # (replica, text, fresh)
        for path in sorted(self.folder.glob("*.prom")):
            try:
                text = path.read_text()
                fresh = now - path.stat().st_mtime <= STALE_AFTER_S
            except OSError:  # replaced or removed meanwhile: its next version is read next time
                continue
            published.append((path.stem, text, fresh))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(published))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Merged:
    """A collector yielding the merged families of the published expositions."""

    def __init__(self, published: list[tuple[str, str, bool]]):
        self._published = published

    def collect(self):
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple, float]] = {}
        for replica, text, fresh in self._published:
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                    sums[family.name] = {}
                total = sums[family.name]
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
                    if sample.name.endswith("_created") or (family.type == "gauge" and not fresh):
                        continue
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    total[key] = total.get(key, 0.0) + sample.value
        for name, metric in families.items():
            for (sample_name, labels), value in sums[name].items():
                metric.add_sample(sample_name, {**dict(labels), "replica": ALL}, value)
            yield metric
