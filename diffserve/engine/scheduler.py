"""`RequestScheduler`: the request lifecycle, one engine tick at a time (vLLM v1's scheduler).

Each tick the engine calls `schedule()`, hands the plain `SchedulerOutput` it returns to the
executor (ONE call), and applies the workers' `RunnerOutput` with `update_from_output()`:

    schedule()            aborts applied, waiting requests admitted (their prepare goes out as
                          `new_requests`), the step's batch chosen (`RequestQueues`), and the
                          decodes, previews, chunk boundaries and frees the previous tick's
                          results asked for
    update_from_output()  the step booked (`StepRun`: once for an unchanged batch; request by
                          request where the workers reported something about single requests),
                          requests done denoising moved to decoding (or to their chunk
                          boundary), previews asked for, and the background work that came
                          back applied: prepared, decoded (final or preview), chunk boundaries
                          done, failures

Join wait: a request admitted while a batch of its batch key is stepping would, with its prepare
running beside the step, join one step later than it could. So a tick that admits such a request
holds its step (steps nothing) and the executor waits for the tick's prepares, up to
`JOIN_WAIT_FRACTION` (`RequestScheduler.join_wait_fraction`) x the step's predicted seconds;
the engine's next tick then steps with the newcomers in the batch. It holds only when the
measured prepare time (an exponential moving average of the workers' `Prepared.seconds`) fits
in that bound, and never two ticks in a row, so arrivals cannot starve the running batch: the
running requests lose at most the bound per admitting tick, a newcomer gains one step.
Counted as ``join_waits`` in `stats()`.

Multi-stage models (an AR stage before the DiT stage, `ModelInfo.ar_stage`): a request starts
in phase AR_STAGE: it is submitted to the AR stage client (`diffserve.executor.ar_stage`, which
batches the generation of all requests in it beside the DiT steps) and enters the waiting queue
only when its generation ends, with the `PayloadHandle` of its payloads (so the DiT stage's
admission never holds rows for a payload that does not exist yet, and its fairness rule is
unchanged); its text streams as ``ar_delta`` events meanwhile. At admission its `NewRequest`
carries the handle (the worker starts the fetch there). Whenever it ends, in any phase, its
payloads are freed in the AR stage (an abort in phase AR_STAGE aborts its generation).

A request's phases (`Phase`): WAITING -> PREPARING -> DENOISING -> DECODING -> DONE, a stream
going DENOISING -> BETWEEN_CHUNKS -> DENOISING for each chunk after the first; an abort or a
failure ends it in any phase (a request being prepared, decoded or between chunks is closed
when that work comes back). Every change is a `StreamEvent`, delivered to the request's
listener or kept for `take_events()`; the final one carries the `GenerationOutput`.

The scheduler holds plain data only (tensors live in the workers) and needs no model: its
tests drive it with fake runner outputs (``tests/engine/test_scheduler.py``). It is not
thread-safe: the engine calls it with its lock held.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from diffserve.core.errors import InteractionRefusedError, InvalidRequestError
from diffserve.core.errors import DeadlineUnmeetableError, EngineOverloadedError
from diffserve.core.messages import (
    ChunkDone,
    ChunkWork,
    Decoded,
    Interaction,
    ModelInfo,
    NewRequest,
    Prepared,
    RunnerOutput,
    SchedulerOutput,
    StepOutput,
    WorkError,
)
from diffserve.core.outputs import EventType, GenerationOutput, RequestStatus, StreamEvent
from diffserve.engine.queues import RequestQueues
from diffserve.engine.request import Phase, Request
from diffserve.engine.scheduler_stats import SchedulerCounters
from diffserve.engine.step_run import StepRun

if TYPE_CHECKING:
    from diffserve.engine.input_processor import ProcessedRequest

logger = logging.getLogger(__name__)

#: A tick that admits a request able to join the stepping batch waits for its prepare at most
#: this fraction of the step's predicted seconds (the module docstring's join wait).
JOIN_WAIT_FRACTION = 0.25
#: Weight of the newest prepare in the moving average of prepare seconds.
PREPARE_EMA_WEIGHT = 0.2

#: Ids of ended requests remembered, so an interaction for one is told it ended (not unknown).
ENDED_IDS = 4096

_FINAL_EVENTS = {RequestStatus.FINISHED: EventType.FINISHED, RequestStatus.FAILED: EventType.FAILED,
                 RequestStatus.ABORTED: EventType.ABORTED}


class RequestScheduler:
    """Requests from arrival to their final event (see the module docstring).

    Args:
        queues: the admission and batch policy (`RequestQueues`).
        model_info: the loaded model (video or images, chunk streaming).
        peak_memory_bytes: the workers' memory peak, read when a request ends (bytes).
        notify: called after events were handed to listeners (once per batch of events; the
            engine wakes the threads waiting for them).
        ar_stage: multi-stage models: the AR stage client (``submit(request_id, prompt,
            params, on_delta) -> Future`` of its ``ARDone``, ``abort(request_id)``,
            ``free(request_ids)``); None for single-stage models.
        admission: ``"all"`` or ``"slo"`` (refuse at arrival a request whose ``deadline_s``
            the queues' step cost model predicts it cannot meet).
    """

    def __init__(self, queues: RequestQueues, model_info: ModelInfo,
                 peak_memory_bytes: Callable[[], int] = lambda: 0, notify: Callable[[], None] | None = None,
                 ar_stage=None, admission: str = "all"):
        self.queues = queues
        self.admission = admission
        self.counters = SchedulerCounters()
        self.ar_stage = ar_stage
        #: requests in the AR stage: id -> the future of its result
        self._ar_work: dict[str, Future] = {}
        #: (request id, text) pieces of AR text, appended by the AR stage's threads
        self._ar_deltas: deque[tuple[str, str]] = deque()
        self.model_info = model_info
        self._is_video = model_info.spec.default_num_frames is not None
        self._peak_memory_bytes = peak_memory_bytes
        self._notify = notify
        #: unfinished requests by id (waiting or running)
        self.requests: dict[str, Request] = {}
        #: ids of running requests whose abort was asked and not yet applied
        self._aborting: set[str] = set()
        #: the steps of the current unchanged batch, not yet booked on its requests
        self._run: StepRun | None = None
        #: events of requests without a listener, until `take_events`
        self._events: list[StreamEvent] = []
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._seq = itertools.count()
        # work for the next scheduler output
        self._decodes: list[str] = []
        self._previews: list[str] = []
        self._chunks: list[ChunkWork] = []
        self._finished: list[str] = []
        #: moving average of the workers' prepare seconds (None before the first prepare)
        self._prepare_s: float | None = None
        #: the previous tick held its step for a join wait (the next one steps)
        self._held = False
        #: the join wait's bound as a fraction of the step's predicted seconds (0 = never hold)
        self.join_wait_fraction = JOIN_WAIT_FRACTION

    # ------------------------------------------------------------------ arrivals and aborts
    def add_request(self, processed: ProcessedRequest, request_id: str | None = None,
                    preview_steps: Sequence[int] = (), listener: Callable[[StreamEvent], None] | None = None,
                    progress: bool = True) -> str:
        """Queue a processed request (its ``queued`` event is emitted); returns its id.

        Args:
            request_id: its id (a fresh uuid when None); unique among live requests.
            preview_steps: steps after which a decoded preview is emitted (``partial``).
            listener: receives each of its events instead of `take_events`.
            progress: emit a ``progress`` event after every denoising step.

        Raises:
            InvalidRequestError: `request_id` is already live.
            EngineOverloadedError: the waiting queue is full.
        """
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError("request_id", request_id, "unique among live requests")
        plan = processed.plan
        tokens = plan.rows * self._tokens_per_row(processed.params)
        request = Request(request_id=request_id, prompt=processed.prompt, params=processed.params,
                          inputs=processed.inputs, batch_key=plan.batch_key, rows=plan.rows, seq=next(self._seq),
                          arrival_time=time.perf_counter(), preview_steps=frozenset(int(s) for s in preview_steps),
                          listener=listener, progress=bool(progress), memory_bytes=processed.memory_bytes,
                          token_bytes=processed.token_bytes,
                          num_steps=plan.num_steps, tokens=tokens, grid=self._row_grid(processed.params))
        if self.admission == "slo" and processed.params.deadline_s is not None:
            self._admit_deadline(request)
        request.metrics.arrival_time = time.time()
        if self.ar_stage is None:
            self.queues.add(request)
        else:  # the AR stage first; it joins the waiting queue when its generation ends
            if len(self.queues.waiting) + len(self._ar_work) >= self.queues.max_waiting:
                raise EngineOverloadedError(f"waiting queue is full ({self.queues.max_waiting} requests, the AR "
                                            "stage's included); retry later")
            request.phase = Phase.AR_STAGE
        self.requests[request_id] = request
        self._emit([StreamEvent(request_id, EventType.QUEUED)])
        if self.ar_stage is not None:
            on_delta = None
            if request.progress:
                def on_delta(text: str, rid: str = request_id) -> None:  # (an AR stage thread)
                    self._ar_deltas.append((rid, text))
            try:
                self._ar_work[request_id] = self.ar_stage.submit(request_id, request.prompt, request.params,
                                                                 on_delta)
            except BaseException:
                self.requests.pop(request_id, None)
                raise
        return request_id

    def _latent_cells(self, params) -> tuple[int, int]:
        """A row's (height / f, width / f) token cells, f the model's resolution factor (the
        model's default size where the request has none)."""
        spec = self.model_info.spec
        f = max(spec.resolution_factor, 1)
        height, width = params.height or spec.default_height, params.width or spec.default_width
        return max(height // f, 1), max(width // f, 1)

    def _row_grid(self, params) -> tuple[int, ...]:
        """A row's token grid (latent frames, height / f, width / f) for video, whose forwards
        pad each axis to the batch's largest (`Request.grid`); () for images (sequences
        padded to the longest)."""
        spec = self.model_info.spec
        if spec.default_num_frames is None:
            return ()
        frames = 1 if not params.num_frames else (params.num_frames - 1) // max(spec.frame_factor, 1) + 1
        return (frames, *self._latent_cells(params))

    def _tokens_per_row(self, params) -> int:
        """Image tokens of one row of a request (`Request.tokens`)."""
        return math.prod(self._row_grid(params) or self._latent_cells(params))

    def _admit_deadline(self, request: Request) -> None:
        """``--admission slo``: refuse a request whose deadline the cost model says it misses
        (`RequestQueues.predict_latency`: its own steps, a stream's every chunk's, at the load
        it would join, plus the work of the requests ranked ahead of it when its rows do not
        fit). Nothing is refused before the first step is measured.

        Raises:
            DeadlineUnmeetableError: with the predicted and the asked seconds.
        """
        prediction = self.queues.predict_latency(request)
        if prediction is None:
            return
        predicted, step, ahead = prediction
        deadline_s = request.params.deadline_s
        if predicted > deadline_s:
            self.counters.refused += 1
            raise DeadlineUnmeetableError(
                f"deadline_s {deadline_s:g} s cannot be met at the current load: predicted {predicted:.3g} s "
                f"({request.remaining_steps} steps + {ahead:.3g} steps of work ahead, {step * 1000:.3g} ms a step); retry later "
                "or ask for a longer deadline")

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request. A waiting one is closed at once; a running one
        at the next `schedule()` (one being prepared, decoded or between two chunks: when that
        work comes back, without emitting its output). Returns False if unknown or ended."""
        request = self.requests.get(request_id)
        if request is None or request.status.is_final:
            return False
        if request.phase is Phase.AR_STAGE or self.queues.remove_waiting(request_id) is not None:
            # never started (or still in the AR stage, which `_close` aborts): its slot is free now
            self._close(request, RequestStatus.ABORTED)
        else:
            request.abort_requested = True
            self._aborting.add(request_id)
        return True

    def fail_waiting(self, request_id: str, error: BaseException) -> bool:
        """Fail a request that is still waiting (e.g. its LoRA adapter failed to load): it
        leaves the queue and its final event (``failed``, with `error`) is emitted. Returns
        False when it is not waiting."""
        request = self.queues.remove_waiting(request_id)
        if request is None:
            return False
        self._close(request, RequestStatus.FAILED, error=error)
        return True

    def submit_interaction(self, request_id: str, interaction: Interaction) -> str:
        """Queue a checked interaction for a running stream's next chunk boundary; returns its
        event id.

        Raises:
            InteractionRefusedError: unknown or ended (or aborting) request, a request without
                ``num_chunks``, a model that cannot stream chunks, or no chunk left after the
                one in progress (`InteractionRefusedError.reason` says which).
        """
        request = self.requests.get(request_id)
        if request is None or request.abort_requested:
            if request is None and request_id not in self._ended:
                raise InteractionRefusedError(request_id, "unknown_request", "the id of a running stream",
                                              "no such request")
            raise InteractionRefusedError(request_id, "finished", "the id of a running stream",
                                          "the request has ended")
        if not request.streaming:
            if not self.model_info.chunk_streaming:
                raise InteractionRefusedError(request_id, "unsupported", "the id of a running stream",
                                              f"{self.model_info.pipeline} cannot stream video chunks, so "
                                              "its requests take no interactions")
            raise InteractionRefusedError(request_id, "not_streaming", "the id of a running stream",
                                          "an ordinary request (without num_chunks) takes no interactions")
        first = request.chunk_index + (2 if request.phase is Phase.BETWEEN_CHUNKS else 1)
        if first >= request.params.num_chunks:
            raise InteractionRefusedError(request_id, "last_chunk", "the id of a stream with a chunk left",
                                          f"no chunk after chunk {first - 1} of {request.params.num_chunks} "
                                          "would use the prompt")
        request.interactions.append(interaction)
        return interaction.event_id

    def fail_all(self, message: str) -> None:
        """Fail every unfinished request with `message` (the engine itself broke); their
        states are freed with the next output."""
        for request in list(self.requests.values()):
            if self.queues.remove_waiting(request.request_id) is None:  # admitted: the workers may hold it
                self.queues.finish(request)
                self._finished.append(request.request_id)
            self._close(request, RequestStatus.FAILED, error=RuntimeError(message))

    # ------------------------------------------------------------------ one tick
    def schedule(self) -> SchedulerOutput:
        """This tick's `SchedulerOutput` (see the module docstring): applies aborts, admits,
        picks the step's batch and hands over the work the previous results asked for.

        An unchanged batch costs no per-request work: the batch and its id list are the same
        objects as the previous tick's."""
        if self._aborting:
            self._apply_aborts()
        if self._ar_work or self._ar_deltas:
            self._collect_ar_stage()
        new_requests = ()
        admitted = self.queues.admit()
        if admitted:
            now = time.perf_counter()
            for request in admitted:
                request.phase = Phase.PREPARING
                request.status = RequestStatus.RUNNING
                request.metrics.queue_s = now - (request.ar_end_time or request.arrival_time)
                self.counters.queued(request.params.priority, request.metrics.queue_s)
            self._emit([StreamEvent(r.request_id, EventType.STARTED, step=0, total=r.num_steps) for r in admitted])
            new_requests = [NewRequest(r.request_id, r.prompt, r.params, r.inputs, context=r.context)
                            for r in admitted]
        step_ids = ()
        batch = self.queues.select_batch()
        join_wait_s = self._join_wait(admitted, batch) if admitted and batch else 0.0
        self._held = join_wait_s > 0
        if batch and not self._held:
            run = self._run
            if run is None or run.batch is not batch:
                self._end_run()
                run = self._run = StepRun.start(batch, time.perf_counter())
            step_ids = run.ids
        out = SchedulerOutput(step_ids=step_ids, new_requests=new_requests, join_wait_s=join_wait_s)
        if self._decodes:
            out.decodes, self._decodes = self._decodes, []
        if self._previews:
            out.previews, self._previews = self._previews, []
        if self._chunks:
            out.chunks, self._chunks = self._chunks, []
        if self._finished:
            out.finished_ids, self._finished = self._finished, []
        return out

    def _join_wait(self, admitted: list[Request], batch: list[Request]) -> float:
        """Seconds this tick's step is held for the prepares of `admitted` (the module
        docstring's join wait), or 0 when: the previous tick held; none of them has `batch`'s
        batch key; no prepare or no step has been measured yet; or the measured prepare time
        exceeds the bound, `join_wait_fraction` x the step's predicted seconds."""
        if self._held or self._prepare_s is None or self.queues.mode != "step":
            return 0.0
        key = batch[0].batch_key
        if not any(r.batch_key == key for r in admitted):
            return 0.0
        step_s = self.queues.cost_model.predict(self.queues.cost_tokens)
        if step_s is None:
            return 0.0
        bound = self.join_wait_fraction * step_s
        if bound <= 0 or self._prepare_s > bound:
            return 0.0
        self.counters.join_waits += 1
        return bound

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """Apply the workers' `result` for `out` (see the module docstring)."""
        if result.step is not None:
            tokens = self.queues.batch_tokens
            self.counters.forward(result.step.num_rows, tokens, self.queues.batch_slots)
            # token slots: what a padded forward of mixed sizes computes (= tokens at one size;
            # real tokens where the model's forwards skip the padding)
            self.queues.cost_model.observe(self.queues.cost_tokens, result.step_end - result.step_start)
            self._book_step(out.step_ids, result.step, result.step_end)
        if result.prepared:
            self._on_prepared(result.prepared)
        if result.decoded:
            self._on_decoded(result.decoded)
        if result.chunks:
            self._on_chunks(result.chunks)
        for request_ids, error in result.failed:
            self._fail(request_ids, error)

    def ar_futures(self) -> list[Future]:
        """The futures of the requests in the AR stage (the engine waits on them when a tick
        has nothing else to do)."""
        return list(self._ar_work.values())

    def _collect_ar_stage(self) -> None:
        """Emit the AR text that arrived, and move requests whose AR stage ended into the
        waiting queue (with their payloads' handle) or fail them (their AR stage failed)."""
        while self._ar_deltas:
            request_id, text = self._ar_deltas.popleft()
            request = self.requests.get(request_id)
            if request is not None and request.phase is Phase.AR_STAGE:
                self._emit([StreamEvent(request_id, EventType.AR_DELTA, text=text)])
        for request_id, future in [(i, f) for i, f in self._ar_work.items() if f.done()]:
            del self._ar_work[request_id]
            request = self.requests.get(request_id)
            try:
                done = future.result()
            except Exception as exc:  # noqa: BLE001 - the request's own AR stage failed (or it was aborted)
                if request is not None and request.phase is Phase.AR_STAGE:
                    logger.info("the AR stage of %s failed: %r", request_id, exc)
                    self._close(request, RequestStatus.FAILED, error=exc)
                continue
            if request is None or request.phase is not Phase.AR_STAGE:  # closed meanwhile
                self.ar_stage.free([request_id])
                continue
            request.context, request.ar_text = done.handle, done.text
            request.ar_end_time = time.perf_counter()
            m = request.metrics
            m.ar_queue_s, m.ar_s, m.transfer_s, m.payload_bytes = done.queue_s, done.generate_s, done.export_s, \
                done.nbytes
            request.phase = Phase.WAITING
            self.queues.add(request, bounded=False)  # counted against the bound when it arrived

    # ------------------------------------------------------------------ queries
    def take_events(self) -> list[StreamEvent]:
        """The events of requests without a listener since the last call."""
        events, self._events = self._events, []
        return events

    def has_unfinished_requests(self) -> bool:
        """Any request waiting or running, events not yet taken, or frees not yet sent."""
        return bool(self.requests or self._events or self._finished)

    def has_requests(self) -> bool:
        """Any request held, or worker state still to free (what sleep mode drains)."""
        return bool(self.requests or self._finished)

    def has_batch(self) -> bool:
        """Some request is ready for a denoising step."""
        return bool(self.queues.select_batch())

    def queue_position(self, request_id: str) -> int | None:
        """The 1-based place of a waiting request (1 = admitted next), None when not waiting."""
        for position, request in enumerate(self.queues.waiting, start=1):
            if request.request_id == request_id:
                return position
        return None

    def stats(self) -> dict:
        """The request scheduler's counters (`SchedulerCounters.as_dict`) with its policy, the
        preemptions and the step cost model's fit."""
        return {"scheduling_policy": self.queues.policy, "admission": self.admission,
                **self.counters.as_dict(), "preemptions": self.queues.preemptions,
                "cost_model": self.queues.cost_model.stats()}

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests (being prepared, denoising, between chunks or being decoded)."""
        return len(self.queues.running)

    @property
    def num_running_rows(self) -> int:
        """Denoiser rows held by running requests (guidance branches count)."""
        return self.queues.running_rows

    # ------------------------------------------------------------------ the step
    def _book_step(self, step_ids: list[str], out: StepOutput, end: float) -> None:
        """Book ONE denoising step of `step_ids` on the current `StepRun`; each request's own
        bookkeeping (finish, preview, failure, step key) only at the steps where the run says
        some request needs it (`StepRun.until`) or the workers reported something about single
        requests."""
        run = self._run
        if run is None or run.ids is not step_ids:  # (the batch cannot change during a tick)
            self._end_run()
            self._book_each([self.requests[i] for i in step_ids if i in self.requests], out, end)
            return
        batch = run.batch
        if out.errors or out.steps_done or out.num_steps or out.request_rows:  # per-request outcomes
            self._end_run()
            self._book_each(batch, out, end)
            return
        run.book(out.num_rows, out.offload_loads, out.peak_memory_bytes, end)
        if run.progress:
            self._emit([StreamEvent(r.request_id, EventType.PROGRESS, step=done + run.steps, total=r.num_steps,
                                    chunk_index=r.chunk_index if r.streaming else None)
                        for r, done in run.progress])
        moved = out.step_keys and [r for r in batch if out.step_keys.get(r.request_id, r.step_key) != r.step_key]
        if run.steps < run.until and not moved:
            return
        self._end_run()
        for request in moved or ():
            request.step_key = out.step_keys[request.request_id]
        if moved:
            self.queues.changed()
        self._after_steps(batch)

    def _end_run(self) -> None:
        """Fold the current `StepRun` into its requests."""
        run, self._run = self._run, None
        if run is not None:
            run.fold()

    def _book_each(self, batch: list[Request], out: StepOutput, end: float) -> None:
        """Book one step request by request: the workers reported failures, forwards of each
        request's own, or steps done / totals of its own (the whole-request runner)."""
        errors, steps_done, num_steps, step_keys = out.errors, out.steps_done, out.num_steps, out.step_keys
        loads, peak, request_rows = out.offload_loads, out.peak_memory_bytes, out.request_rows
        stepped, events, keys_moved = [], [], False
        for request in batch:
            request_id = request.request_id
            if errors and request_id in errors:  # the worker freed it
                self.queues.finish(request)
                self._close(request, RequestStatus.FAILED, error=errors[request_id])
                continue
            m = request.metrics
            if request.first_step_time is None:
                request.first_step_time = end
            m.num_steps += 1
            m.offload_loads += loads
            if peak is not None and (m.request_peak_memory_bytes is None or peak > m.request_peak_memory_bytes):
                m.request_peak_memory_bytes = peak
            rows = request_rows.get(request_id, out.num_rows)
            m.batch_sizes[rows] = m.batch_sizes.get(rows, 0) + 1
            m.denoise_s = end - request.first_step_time
            request.steps_done = steps_done.get(request_id, request.steps_done + 1)
            request.num_steps = num_steps.get(request_id, request.num_steps)
            key = step_keys.get(request_id, request.step_key)
            keys_moved = keys_moved or key != request.step_key
            request.step_key = key
            if request.progress:
                events.append(StreamEvent(request_id, EventType.PROGRESS, step=request.steps_done,
                                          total=request.num_steps,
                                          chunk_index=request.chunk_index if request.streaming else None))
            stepped.append(request)
        self._emit(events)
        if keys_moved:
            self.queues.changed()
        self._after_steps(stepped)

    def _after_steps(self, requests: list[Request]) -> None:
        """Requests whose steps are booked: those done denoising go to decode (or to their
        chunk boundary), those at a preview step get a preview decode (next output)."""
        changed = False
        for request in requests:
            done = request.steps_done
            if done >= request.num_steps:
                changed = True
                if request.streaming:
                    request.phase = Phase.BETWEEN_CHUNKS
                    self._chunks.append(ChunkWork(request.request_id, request.interactions))
                    request.interactions = []
                else:
                    request.phase = Phase.DECODING
                    self._decodes.append(request.request_id)
            elif request.preview_steps and done in request.preview_steps and not request.abort_requested:
                self._previews.append(request.request_id)
        if changed:
            self.queues.changed()

    # ------------------------------------------------------------------ aborts and failures
    def _apply_aborts(self) -> None:
        """Close running requests that asked to abort, except those being prepared, decoded or
        between chunks (closed when that work comes back)."""
        asked = sorted((self.requests[i] for i in self._aborting if i in self.requests), key=lambda r: r.seq)
        for request in asked:
            if request.phase in (Phase.PREPARING, Phase.DECODING, Phase.BETWEEN_CHUNKS):
                continue
            self.queues.remove_waiting(request.request_id)
            self.queues.finish(request)
            self._finished.append(request.request_id)
            self._close(request, RequestStatus.ABORTED)

    def _fail(self, request_ids: list[str], error: WorkError) -> None:
        """Fail the requests of a work item that raised as a whole (an executor fault)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self.queues.finish(request)
                self._finished.append(request_id)
                self._close(request, RequestStatus.FAILED, error=error)

    # ------------------------------------------------------------------ background results
    def _on_prepared(self, results: list[Prepared]) -> None:
        for result in results:
            request = self.requests.get(result.request_id)
            if request is None:  # failed or closed meanwhile
                self._finished.append(result.request_id)
                continue
            request.metrics.encode_s = result.seconds
            self._prepare_s = result.seconds if self._prepare_s is None else \
                (1 - PREPARE_EMA_WEIGHT) * self._prepare_s + PREPARE_EMA_WEIGHT * result.seconds
            request.metrics.offload_loads += result.offload_loads
            request.metrics.payload_wait_s += result.payload_wait_s
            request.metrics.transfer_s += result.payload_fetch_s
            request.prompt_truncated = result.prompt_truncated
            request.negative_prompt_truncated = result.negative_prompt_truncated
            if result.error is not None:  # an abort asked meanwhile wins, as for decode and chunks
                self.queues.finish(request)
                if request.abort_requested:
                    self._close(request, RequestStatus.ABORTED)
                else:
                    self._close(request, RequestStatus.FAILED, error=result.error)
                continue
            request.num_steps = result.num_steps
            request.step_key = result.step_key
            request.phase = Phase.DENOISING
            self.queues.changed()
            if request.abort_requested:
                self._apply_aborts()

    def _on_decoded(self, results: list[Decoded]) -> None:
        for result in results:
            request = self.requests.get(result.request_id)
            if request is None:
                continue
            request.metrics.offload_loads += result.offload_loads
            if result.preview:
                if result.error is None and not request.abort_requested:
                    self._emit([StreamEvent(request.request_id, EventType.PARTIAL, step=result.step,
                                            total=request.num_steps, preview=result.output)])
                continue
            self.queues.finish(request)
            if request.abort_requested:
                self._close(request, RequestStatus.ABORTED)
            elif result.error is not None:
                self._close(request, RequestStatus.FAILED, error=result.error)
            else:
                request.metrics.decode_s = result.seconds
                if result.cache is not None:
                    m = request.metrics
                    m.cache_quality = result.cache["cache_quality"]
                    m.cache_skipped_steps = result.cache["skipped_steps"]
                    m.cache_error_estimate = result.cache["error_estimate"]
                    m.cache_check_steps = result.cache["check_steps"]
                self._close(request, RequestStatus.FINISHED, images=result.output)

    def _on_chunks(self, results: list[ChunkDone]) -> None:
        now = time.perf_counter()
        for result in results:
            request = self.requests.get(result.request_id)
            if request is None:
                self._finished.append(result.request_id)
                continue
            request.metrics.offload_loads += result.offload_loads
            request.metrics.decode_s += result.seconds
            if request.abort_requested or result.error is not None:
                self.queues.finish(request)
                self._finished.append(request.request_id)
                if request.abort_requested:
                    self._close(request, RequestStatus.ABORTED)
                else:
                    self._close(request, RequestStatus.FAILED, error=result.error)
                continue
            request.metrics.chunk_s.append(now - request.arrival_time)
            self._emit([StreamEvent(request.request_id, EventType.CHUNK, chunk_index=result.chunk_index,
                                    output=result.frames, event_ids=list(result.event_ids))])
            if result.video is not None:
                self.queues.finish(request)
                self._close(request, RequestStatus.FINISHED, images=[result.video])
                continue
            request.chunk_index = result.chunk_index + 1
            request.num_steps = result.num_steps
            request.steps_done = 0
            request.step_key = result.step_key
            request.phase = Phase.DENOISING
            self.queues.changed()

    # ------------------------------------------------------------------ endings and events
    def _close(self, request: Request, status: RequestStatus, images=None,
               error: BaseException | WorkError | None = None) -> None:
        """Close a request: fill its metrics, emit its final event, forget it."""
        if request.phase is Phase.DENOISING:  # it may be stepping in the current run: book it first
            self._end_run()
        if self.ar_stage is not None:  # its payloads go in the AR stage, wherever it ended
            if request.phase is Phase.AR_STAGE:
                self._ar_work.pop(request.request_id, None)
                self.ar_stage.abort(request.request_id)
            self.ar_stage.free([request.request_id])
        request.status = status
        request.phase = Phase.DONE
        m = request.metrics
        m.total_s = time.perf_counter() - request.arrival_time
        m.peak_memory_bytes = self._peak_memory_bytes()
        if request.params.deadline_s is not None and status is RequestStatus.FINISHED:
            m.deadline_met = m.total_s <= request.params.deadline_s
            self.counters.finished_with_deadline(m.deadline_met, request.params.num_images_per_prompt)
        if error is None:
            message = None
        elif isinstance(error, WorkError):
            message = str(error)
        else:
            message = f"{type(error).__name__}: {error}"
        media = images if images is not None else []
        output = GenerationOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            images=[] if self._is_video else media,
            videos=media if self._is_video else [],
            seed=request.params.seed,
            status=status,
            metrics=m,
            prompt_truncated=request.prompt_truncated,
            negative_prompt_truncated=request.negative_prompt_truncated,
            error=message,
            error_type=error.type if isinstance(error, WorkError) else (
                type(error).__name__ if error is not None else None),
            error_param=error.field if isinstance(error, InvalidRequestError) else None,
            params=request.params,
            ar_text=request.ar_text,
        )
        self._emit([StreamEvent(request.request_id, _FINAL_EVENTS[status], output=output, error=message)])
        self.requests.pop(request.request_id, None)
        self._aborting.discard(request.request_id)
        self._ended[request.request_id] = None
        while len(self._ended) > ENDED_IDS:
            self._ended.popitem(last=False)

    def _emit(self, events: list[StreamEvent]) -> None:
        """Route events: to their request's listener, else to `take_events`; then `notify`
        (once per call, not per event) if a listener got one."""
        delivered = False
        for event in events:
            request = self.requests.get(event.request_id)
            listener = request.listener if request is not None else None
            if listener is None:
                self._events.append(event)
            else:
                delivered = True
                try:
                    listener(event)
                except Exception:  # noqa: BLE001 - a consumer's bug must not break the engine
                    logger.exception("event listener for %s raised", event.request_id)
        if delivered and self._notify is not None:
            self._notify()
