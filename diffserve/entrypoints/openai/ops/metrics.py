"""Prometheus metrics of the HTTP server (``GET /metrics``), one `CollectorRegistry` per app.

Metrics (all durations in seconds):
    diffserve_requests_total{status}            generation HTTP requests (image generations and edits,
                                                video job creations) by response status (499 = client
                                                disconnected first)
    diffserve_engine_requests_total{outcome}    engine requests (one per image) by outcome:
                                                finished / failed / aborted (requests of an
                                                HTTP request rejected with 429 are not counted)
    diffserve_images_generated_total            images returned to clients
    diffserve_videos_generated_total            videos of completed video jobs and video streams
    diffserve_num_requests_waiting              engine requests in the waiting queue
    diffserve_num_requests_running              engine requests holding latents
    diffserve_num_running_rows                  transformer rows of the running requests
    diffserve_step_duration_seconds             one denoising step (one batched forward + the
                                                diffusion-scheduler steps)
    diffserve_step_batch_rows                   transformer rows per step (CFG rows included)
    diffserve_step_batch_requests               requests per step
    diffserve_request_stage_seconds{stage}      per finished engine request: queue, encode,
                                                denoise, decode, total; multi-stage models also
                                                ar_queue, ar (generation), transfer (payload
                                                export + fetch), payload_wait (DiT-side wait)
    diffserve_ar_stage_requests_total{outcome}, diffserve_ar_stage_tokens_total
                                                multi-stage models: requests through the AR stage
                                                (finished / failed / aborted), tokens generated
    diffserve_payload_bytes_put_total, diffserve_payload_dedup_hits_total,
    diffserve_payload_bytes_received_total, diffserve_payloads_resident{unit}
                                                multi-stage models: bytes the AR stage put into the
                                                connector, identical payloads stored once, bytes
                                                the DiT side received, and what is resident now
                                                (unit: requests / payloads / bytes)
    diffserve_prompt_embed_cache_{hits,misses,evictions}_total, diffserve_prompt_embed_cache_entries
                                                the prompt-embedding LRU (when enabled)
    diffserve_cache_backend_{transformer_calls,skipped}_total{backend}
                                                denoiser calls and the ones a cache backend skipped
    diffserve_compile_recompiles_after_warmup   torch.compile graphs compiled after warm-up
    diffserve_nonfinite_outputs_total           engine requests failed because the denoiser or the VAE
                                                produced NaN/inf (`NonFiniteOutputError`)
    diffserve_connections_open                  connections held now (served, and being refused)
    diffserve_connections_accepted_total        connections accepted
    diffserve_connections_refused_total         connections answered 503: --max-connections were open
    diffserve_accept_errors_total{error}        failed accepts by errno name (EMFILE, ENFILE, ...: the
                                                process or system ran out of descriptors; accepting
                                                pauses, see `diffserve.entrypoints.openai.acceptor`)
    diffserve_accept_paused                     1 while accepting is paused (connection limit or
                                                accept errors: new connections wait in the backlog)

The step metrics come from the engine's step listener (`EngineClient.add_step_listener`);
the engine counters (acceleration, non-finite outputs) from `EngineClient.stats` at scrape
time; the connection counters from the server's `ConnectionStats` (`connections`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from diffserve.core.outputs import GenerationOutput, RequestStatus
from diffserve.entrypoints.openai.acceptor import ConnectionStats

if TYPE_CHECKING:
    from diffserve.engine.client import EngineClient

STAGES = ("queue", "encode", "denoise", "decode", "total")
#: multi-stage models' extra stages (observed for requests that went through an AR stage)
AR_STAGES = ("ar_queue", "ar", "transfer", "payload_wait")
_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: relative error estimates of step caching (`RequestMetrics.cache_error_estimate`)
_CACHE_ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """The server's collectors, registered in a private `CollectorRegistry`.

    Thread-safe: the step metrics are recorded on the engine thread, the rest on the event loop.
    """

    def __init__(self) -> None:
        #: what ``GET /metrics`` answers (`render`, or every replica's merged: `set_view`)
        self._view: Callable[[], tuple[bytes, str]] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("diffserve_requests", "Generation HTTP requests (images, edits, video jobs) by "
                                "response status (499: the client disconnected first).", ["status"], registry=r)
        self.engine_requests = Counter("diffserve_engine_requests", "Engine requests (one per image) by "
                                       "outcome.", ["outcome"], registry=r)
        self.images = Counter("diffserve_images_generated", "Images returned to clients.", registry=r)
        self.videos = Counter("diffserve_videos_generated", "Videos of completed video jobs and video streams.", registry=r)
        self.waiting = Gauge("diffserve_num_requests_waiting", "Engine requests in the waiting queue.",
                             registry=r)
        self.running = Gauge("diffserve_num_requests_running", "Engine requests holding latents.", registry=r)
        self.running_rows = Gauge("diffserve_num_running_rows", "Transformer rows of the running requests.",
                                  registry=r)
        self.step_seconds = Histogram("diffserve_step_duration_seconds", "Duration of one denoising step "
                                      "(batched forward + scheduler steps), seconds.", buckets=_STEP_BUCKETS,
                                      registry=r)
        self.step_rows = Histogram("diffserve_step_batch_rows", "Transformer rows per denoising step (CFG "
                                   "rows included).", buckets=_ROW_BUCKETS, registry=r)
        self.step_requests = Histogram("diffserve_step_batch_requests", "Requests per denoising step.",
                                       buckets=_ROW_BUCKETS, registry=r)
        self.stage_seconds = Histogram("diffserve_request_stage_seconds", "Per finished engine request: "
                                       "duration of each stage, seconds.", ["stage"], buckets=_STAGE_BUCKETS,
                                       registry=r)
        self.cache_skipped_steps = Counter(
            "diffserve_request_cache_skipped_steps", "Denoising steps whose transformer blocks were skipped "
            "(step caching), by the request's cache_quality.", ["cache_quality"], registry=r)
        self.cache_error_estimate = Histogram(
            "diffserve_request_cache_error_estimate", "Per finished engine request with step caching: the run-time "
            "guard's final estimate of the relative error skipping added, by cache_quality.", ["cache_quality"],
            buckets=_CACHE_ERROR_BUCKETS, registry=r)
        #: counted by the server's connection acceptors (`diffserve.entrypoints.openai.server`)
        self.connections = ConnectionStats()
        r.register(_ConnectionCollector(self.connections))
        for outcome in ("finished", "failed", "aborted"):
            self.engine_requests.labels(outcome=outcome)
        for stage in STAGES:
            self.stage_seconds.labels(stage=stage)

    def observe_engine(self, engine: EngineClient) -> None:
        """Read queue gauges from `engine` at scrape time and record every denoising step."""
        self.waiting.set_function(lambda: engine.num_waiting)
        self.running.set_function(lambda: engine.num_running)
        self.running_rows.set_function(lambda: engine.num_running_rows)
        engine.add_step_listener(self._observe_step)
        self.registry.register(_EngineCollector(engine.stats))
        self.registry.register(_MultiStageCollector(engine.stats))  # (empty for single-stage models)

    def _observe_step(self, num_rows: int, num_requests: int, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.step_rows.observe(num_rows)
        self.step_requests.observe(num_requests)

    def observe_status(self, status_code: int) -> None:
        """Count one generation HTTP request that ended with `status_code`."""
        self.requests.labels(status=str(status_code)).inc()

    def observe_output(self, output: GenerationOutput) -> None:
        """Record an engine request's outcome and, when finished, its stage durations."""
        outcome = {RequestStatus.FINISHED: "finished", RequestStatus.FAILED: "failed"}.get(output.status, "aborted")
        self.engine_requests.labels(outcome=outcome).inc()
        if output.status is RequestStatus.FINISHED:
            m = output.metrics
            for stage, seconds in zip(STAGES, (m.queue_s, m.encode_s, m.denoise_s, m.decode_s, m.total_s)):
                self.stage_seconds.labels(stage=stage).observe(seconds)
            if m.cache_quality is not None:  # step caching kept a record of the request
                self.cache_skipped_steps.labels(cache_quality=m.cache_quality).inc(m.cache_skipped_steps)
                self.cache_error_estimate.labels(cache_quality=m.cache_quality).observe(m.cache_error_estimate or 0.0)
            if m.payload_bytes:  # a multi-stage model's request
                for stage, seconds in zip(AR_STAGES, (m.ar_queue_s, m.ar_s, m.transfer_s, m.payload_wait_s)):
                    self.stage_seconds.labels(stage=stage).observe(seconds)

    def observe_abandoned(self, count: int, outcome: str = "aborted") -> None:
        """Count `count` engine requests whose final event no client read (the client went
        away): they were aborted in the engine."""
        if count:
            self.engine_requests.labels(outcome=outcome).inc(count)

    def observe_images(self, count: int) -> None:
        """Count `count` images returned to a client."""
        self.images.inc(count)

    def observe_videos(self, count: int) -> None:
        """Count `count` videos stored for completed jobs."""
        self.videos.inc(count)

    def render(self) -> tuple[bytes, str]:
        """The exposition text of this server's own metrics and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def set_view(self, view: Callable[[], tuple[bytes, str]]) -> None:
        """Answer ``GET /metrics`` with `view` instead of `render` (replicas: every replica's
        metrics merged, `diffserve.entrypoints.openai.ops.replica_metrics`)."""
        self._view = view

    def exposition(self) -> tuple[bytes, str]:
        """What ``GET /metrics`` answers: the view when one is set, else `render`."""
        return (self._view or self.render)()


class _EngineCollector:
    """Exports the engine's counters (`DiffusionEngine.stats`, read at scrape time): the
    runner's acceleration stats and the non-finite outputs."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self):
        engine_stats = self._stats()
        yield CounterMetricFamily("diffserve_nonfinite_outputs", "Engine requests failed because the denoiser "
                                  "or the VAE produced NaN/inf.", value=engine_stats.get("nonfinite_outputs", 0))
        stats = engine_stats.get("acceleration", {})
        cache = stats.get("prompt_embed_cache", {})
        if cache.get("enabled"):
            for name in ("hits", "misses", "evictions"):
                yield CounterMetricFamily(f"diffserve_prompt_embed_cache_{name}",
                                          f"Prompt-embedding cache {name}.", value=cache[name])
            yield GaugeMetricFamily("diffserve_prompt_embed_cache_entries",
                                    "Entries in the prompt-embedding cache.", value=cache["size"])
        backend = stats.get("cache_backend", {})
        if "transformer_calls" in backend:
            for key, doc in (("transformer_calls", "Denoiser calls (one per request and step)."),
                             ("skipped", "Denoiser calls a cache backend skipped.")):
                family = CounterMetricFamily(f"diffserve_cache_backend_{key}", doc, labels=["backend"])
                family.add_metric([str(backend.get("name"))], backend[key])
                yield family
        compiled = stats.get("compile", {})
        if compiled.get("enabled"):
            yield GaugeMetricFamily("diffserve_compile_recompiles_after_warmup",
                                    "torch.compile graphs compiled after warm-up.",
                                    value=compiled["recompiles_after_warmup"])
        yield from _scheduler_metrics(engine_stats.get("scheduler"))


def _scheduler_metrics(sched: dict[str, Any] | None):
    """The request scheduler's counters (`RequestScheduler.stats`): rows and tokens per forward,
    queueing delay by priority, SLO attainment and goodput, preemptions, deadline refusals, join
    waits."""
    if not sched:
        return
    yield GaugeMetricFamily("diffserve_rows_per_forward_mean", "Mean denoiser rows per forward since start.",
                            value=sched["mean_rows_per_forward"])
    yield GaugeMetricFamily("diffserve_tokens_per_forward_mean", "Mean image tokens per denoiser forward since "
                            "start.", value=sched["mean_tokens_per_forward"])
    yield GaugeMetricFamily("diffserve_padded_token_share", "Padded share of the image token slots of every "
                            "denoiser forward since start (mixed sizes pad rows to the widest).",
                            value=sched.get("padded_token_share", 0.0))
    yield CounterMetricFamily("diffserve_forwards", "Denoiser forwards run.", value=sched["forwards"])
    yield CounterMetricFamily("diffserve_preemptions", "Step-boundary preemptions (priority / slo policies).",
                              value=sched["preemptions"])
    yield CounterMetricFamily("diffserve_deadline_refusals", "Requests refused at arrival by --admission slo.",
                              value=sched["refused_deadline"])
    yield CounterMetricFamily("diffserve_join_waits", "Engine ticks that held their step for the prepares of "
                              "requests admitted in them (join wait).", value=sched.get("join_waits", 0))
    slo = CounterMetricFamily("diffserve_deadline_requests", "Finished requests with a deadline_s, by whether "
                              "they met it.", labels=["met"])
    slo.add_metric(["true"], sched["slo_met"])
    slo.add_metric(["false"], sched["slo_missed"])
    yield slo
    if sched["slo_attainment"] is not None:
        yield GaugeMetricFamily("diffserve_slo_attainment", "Share of finished requests with a deadline that met "
                                "it.", value=sched["slo_attainment"])
    yield GaugeMetricFamily("diffserve_goodput_images_per_second", "Images of requests that met their deadline, "
                            "per second since start.", value=sched["goodput_images_per_s"])
    delay = GaugeMetricFamily("diffserve_queue_delay_seconds_mean", "Mean seconds admitted requests waited in "
                              "the queue, by priority.", labels=["priority"])
    longest = GaugeMetricFamily("diffserve_queue_delay_seconds_max", "Longest seconds an admitted request waited "
                                "in the queue, by priority.", labels=["priority"])
    for priority, q in sched["queue_delay_s"].items():
        delay.add_metric([priority], q["mean"])
        longest.add_metric([priority], q["max"])
    yield delay
    yield longest


class _MultiStageCollector:
    """Exports a multi-stage model's AR-stage counters and connector accounting (`engine.stats()`
    ``ar_stage`` and ``payloads``, read at scrape time) as Prometheus metrics."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        ar = stats.get("ar_stage", {})
        if "finished" in ar:
            family = CounterMetricFamily("diffserve_ar_stage_requests", "Requests through the AR stage by outcome.",
                                         labels=["outcome"])
            for outcome in ("finished", "failed", "aborted"):
                family.add_metric([outcome], ar[outcome])
            yield family
            yield CounterMetricFamily("diffserve_ar_stage_tokens", "Tokens the AR stage generated.", value=ar["tokens"])
        put = ar.get("connector", {})
        if "bytes_put" in put:
            yield CounterMetricFamily("diffserve_payload_bytes_put", "Bytes the AR stage put into the connector "
                                      "(identical payloads once).", value=put["bytes_put"])
            yield CounterMetricFamily("diffserve_payload_dedup_hits", "Payloads stored once for several requests "
                                      "(equal content hash).", value=put["dedup_hits"])
            family = GaugeMetricFamily("diffserve_payloads_resident", "Payloads held by the AR stage's connector now.",
                                       labels=["unit"])
            for unit in ("requests", "payloads", "bytes"):
                family.add_metric([unit], put[f"resident_{unit}"])
            yield family
        received = stats.get("payloads", {})
        if "bytes" in received:
            yield CounterMetricFamily("diffserve_payload_bytes_received", "Payload bytes the DiT side received.",
                                      value=received["bytes"])



class _ConnectionCollector:
    """Exports a `ConnectionStats` (read at scrape time)."""

    def __init__(self, stats: ConnectionStats):
        self._stats = stats

    def collect(self):
        snap = self._stats.snapshot()
        yield GaugeMetricFamily("diffserve_connections_open", "Connections held now (served and being refused).",
                                value=snap["open"])
        yield CounterMetricFamily("diffserve_connections_accepted", "Connections accepted.", value=snap["accepted"])
        yield CounterMetricFamily("diffserve_connections_refused", "Connections answered 503 because "
                                  "--max-connections were open.", value=snap["refused"])
        errors = CounterMetricFamily("diffserve_accept_errors", "Failed accepts by errno name (EMFILE, ENFILE: out "
                                     "of descriptors; accepting pauses).", labels=["error"])
        for name in sorted({"EMFILE", "ENFILE", *snap["accept_errors"]}):
            errors.add_metric([name], snap["accept_errors"].get(name, 0))
        yield errors
        yield GaugeMetricFamily("diffserve_accept_paused", "1 while accepting is paused (connection limit or accept "
                                "errors); new connections wait in the listen backlog.", value=int(snap["paused"]))


def install_metrics_route(app: FastAPI, metrics: ServerMetrics) -> None:
    """Add ``GET /metrics`` (the Prometheus exposition of `metrics`) to `app`."""

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        """Prometheus exposition of the server's metrics."""
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)
