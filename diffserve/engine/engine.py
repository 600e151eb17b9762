"""`DiffusionEngine`: the request lifecycle (add, step, abort, finish) over an executor.

One `step()` call: collect finished prepare/decode work, apply aborts, admit new requests (their
prepare work is submitted), run ONE denoising step for the batch the request scheduler picks
among the denoising requests, and submit the decode of those that just finished. Prepare and
decode run beside the steps (`diffserve.executor`), so a long encode or decode does not stall
the other requests' steps.

The engine holds plain data only (`Request`); tensors live in the executor's workers.

Streams (``SamplingParams.num_chunks``): a stream whose chunk finished denoising is not
decoded and freed: its chunk boundary (`ChunkWork`: decode the chunk, prepare the next one,
conditioned on it) runs in the background like a decode, while the other requests keep
stepping; the stream keeps its rows and its state in the worker, and comes back to the
request scheduler, with the same batch key, for its next chunk. Each chunk is emitted as a
``chunk`` event as soon as it is decoded; the last one also finishes the request with the whole
video. `submit_interaction` changes the prompt of a running stream's following chunks; the
interaction travels to the workers with the next chunk boundary (plain data, so every executor
forwards it).

Memory: with ``EngineConfig.max_memory`` the request scheduler also admits by estimated
memory (`diffserve.engine.memory_budget`); `sleep` / `wake_up` give the device's memory back
between bursts (`diffserve.memory.sleep`, vLLM's levels 1 and 2).

Threads: any number of threads may call `generate`, `add_request`, `abort` and `step` on one
engine. One thread steps at a time; each request's events go to its owner (the `generate` call
or async consumer that added it, via `Request.listener`) whichever thread stepped, and the
events of requests without a listener are returned by `step()`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from diffserve.config import EngineConfig
from diffserve.engine.request import Phase, Request
from diffserve.engine.scheduler import RequestScheduler
from diffserve.engine.step_run import StepRun
from diffserve.engine.sleep_mode import SleepMode
from diffserve.core.errors import InteractionRefusedError, InvalidRequestError
from diffserve.executor import Executor, InProcessExecutor, build_executor
from diffserve.core.messages import ChunkDone, ChunkWork, Decoded, Interaction, NewRequest, Prepared, WorkError
from diffserve.core.inputs import make_inputs
from diffserve.core.outputs import EventType, GenerationOutput, RequestStatus, StreamEvent
from diffserve.core.sampling_params import SamplingParams, validate_prompt

logger = logging.getLogger(__name__)

#: Longest a stepping thread blocks waiting for background work before re-checking (seconds).
_WAIT_S = 0.05
#: Ids of ended requests remembered, so an interaction for one is told it ended (not unknown).
_ENDED_IDS = 4096
#: Longest ``event_id`` of an interaction, characters.
MAX_EVENT_ID_CHARS = 256
#: Most ``transition_chunks`` of an interaction.
MAX_TRANSITION_CHUNKS = 1024


class DiffusionEngine(SleepMode):
    """Synchronous diffusion serving engine (offline API).

    Args:
        config: engine configuration; None = defaults (the built-in model on the best device).
        runner: an already-built `ModelRunner` to reuse (optional; in-process executor).
        executor: an already-built executor (optional; overrides `runner`).

    Example:
        >>> engine = DiffusionEngine(EngineConfig())
        >>> [out] = engine.generate("a handwritten digit 7", SamplingParams(seed=0))
        >>> out.images[0].save("seven.png")
    """

    def __init__(self, config: EngineConfig | None = None, runner=None, executor: Executor | None = None):
        self.config = config or EngineConfig()
        if executor is None:
            executor = InProcessExecutor(self.config, runner) if runner is not None else build_executor(self.config)
        self.executor = executor
        self.model_info = executor.info()
        #: memory-aware admission (None without ``max_memory``)
        self.memory_budget = None
        if self.config.max_memory is not None:
            from diffserve.engine.memory_budget import MemoryBudget

            self.memory_budget = MemoryBudget.from_config(self.config.max_memory, executor.memory_profile())
        self.scheduler = RequestScheduler(
            self.config.max_batch_size, self.config.max_waiting_requests, self.config.execution_mode,
            memory_limit=self.memory_budget.available if self.memory_budget is not None else None,
        )
        self._init_sleep_mode()
        self._lock = threading.RLock()
        self._mail = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        #: ids of running requests whose abort was asked and not yet applied
        self._aborting: set[str] = set()
        #: the steps of the current unchanged batch, not yet booked on its requests
        self._run: StepRun | None = None
        self._pending: list[StreamEvent] = []
        #: background work in flight: (future, request ids), in submission order
        self._prepare_work: list[tuple[Future, list[str]]] = []
        self._decode_work: list[tuple[Future, list[str]]] = []
        self._chunk_work: list[tuple[Future, list[str]]] = []
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._seq = itertools.count()
        self._step_listeners: list[Callable[[int, int, float], None]] = []

    @property
    def runner(self):
        """The in-process `ModelRunner` (in-process executor only)."""
        return getattr(self.executor, "runner", None)

    @property
    def spec(self):
        """The loaded model's `ModelSpec` (defaults and limits)."""
        return self.model_info.spec

    def add_step_listener(self, listener: Callable[[int, int, float], None]) -> None:
        """Call ``listener(num_rows, num_requests, seconds)`` after every denoising step
        (on the stepping thread): denoiser rows in the forward (guidance branches included),
        requests in the batch, and the step's wall-clock duration in seconds."""
        self._step_listeners.append(listener)

    # ----------------------------------------------------------------- request lifecycle
    def add_request(
        self,
        prompt: str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        preview_steps: Sequence[int] = (),
        inputs: Any = None,
        listener: Callable[[StreamEvent], None] | None = None,
        progress: bool = True,
    ) -> str:
        """Validate and queue one request; returns its id (a fresh uuid when not given).

        Args:
            preview_steps: denoising steps (1-based, counting the steps the request runs: with
                image-to-image strength < 1 fewer than ``num_inference_steps``, see
                `PipelineAdapter.num_steps`) after which a decoded preview of the current latents
                is emitted as a `partial` event.
            inputs: input images (`RequestInputs`, or images in any form
                `diffserve.core.inputs.make_inputs` takes).
            listener: receives each of this request's events (on the stepping thread) instead
                of `step()` returning them.
            progress: emit a ``progress`` event after every denoising step (False: the other
                events only).

        Raises:
            InvalidRequestError: a field is invalid (named in the message), or the request
                alone exceeds ``max_memory``.
            EngineOverloadedError: the waiting queue is full.
            EngineSleepingError: the engine is asleep or going to sleep.
        """
        self._check_awake()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", params, "a SamplingParams")
        spec = self.spec
        prompt = validate_prompt(prompt, spec)
        inputs = make_inputs(inputs) if inputs is not None else None
        resolved = params.resolve(spec, self.config.limits, self.config.default_seed)
        plan = self.executor.plan(resolved, inputs)
        memory_bytes = self.memory_budget.check(resolved, plan.rows) if self.memory_budget is not None else 0
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=resolved,
            inputs=inputs,
            batch_key=plan.batch_key,
            rows=plan.rows,
            seq=next(self._seq),
            arrival_time=time.perf_counter(),
            preview_steps=frozenset(int(s) for s in preview_steps),
            listener=listener,
            progress=bool(progress),
            memory_bytes=memory_bytes,
            num_steps=plan.num_steps,
        )
        request.metrics.arrival_time = time.time()
        with self._lock:
            self._check_awake()
            if request.request_id in self._requests:
                raise InvalidRequestError("request_id", request.request_id, "unique among live requests")
            self.scheduler.add(request)
            self._requests[request.request_id] = request
            self._emit([StreamEvent(request.request_id, EventType.QUEUED)])
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request. A waiting one leaves the queue at once; a
        running one stops at the next step boundary and frees its latents (a stream between
        two chunks: when its chunk boundary work comes back, without emitting that chunk). Its final event
        (`aborted`) comes out of the next `step()`. Returns False if unknown or done."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.status.is_final:
                return False
            if self.scheduler.remove_waiting(request_id) is not None:
                # never started: free its queue slot now; the event goes out with the next step
                self._close(request, RequestStatus.ABORTED)
            else:
                request.abort_requested = True
                self._aborting.add(request_id)
            return True

    def submit_interaction(self, request_id: str, interaction: Mapping[str, Any]) -> str:
        """Change the prompt of a running stream from its next chunk on.

        Args:
            interaction: ``{"prompt": str, "transition_chunks": int = 0, "event_id": str}``:
                the new prompt (checked like a request's), the number of chunks over which the
                text conditioning moves from what the previous chunk used to the new prompt
                (linear interpolation of the prompt embeddings, see
                `diffserve.runner.streaming`; 0 = at once, k = chunks c..c+k use weights
                1/(k+1), ..., 1), and the client's id of this interaction (a fresh uuid when
                absent).

        Returns:
            The event id. It comes back in ``event_ids`` of the first chunk event that uses the
            new prompt: the chunk after the one being denoised (or the one after that, when
            the current chunk is already being decoded).

        Raises:
            InvalidRequestError: an invalid or unknown field (named).
            InteractionRefusedError: unknown request id, ended (or aborting) request, a request
                without ``num_chunks``, a model that cannot stream chunks, or no chunk left
                after the one in progress (`InteractionRefusedError.reason` says which).
        """
        interaction = self._check_interaction(interaction)
        with self._lock:
            request = self._requests.get(request_id)
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

    def _check_interaction(self, interaction: Mapping[str, Any]) -> Interaction:
        """An interaction's fields checked (see `submit_interaction`).

        Raises:
            InvalidRequestError: naming the field.
        """
        if not isinstance(interaction, Mapping):
            raise InvalidRequestError("interaction", interaction, "a mapping with prompt, transition_chunks, event_id")
        unknown = sorted(set(interaction) - {"prompt", "transition_chunks", "event_id"})
        if unknown:
            raise InvalidRequestError(str(unknown[0]), interaction[unknown[0]],
                                      "absent: an interaction takes prompt, transition_chunks and event_id")
        if "prompt" not in interaction:
            raise InvalidRequestError("prompt", None, "a non-empty string (required)")
        prompt = validate_prompt(interaction["prompt"], self.spec)
        k = interaction.get("transition_chunks", 0)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TRANSITION_CHUNKS:
            raise InvalidRequestError("transition_chunks", k, f"an integer in [0, {MAX_TRANSITION_CHUNKS}]")
        event_id = interaction.get("event_id")
        if event_id is None:
            event_id = uuid.uuid4().hex
        elif not isinstance(event_id, str) or not 1 <= len(event_id) <= MAX_EVENT_ID_CHARS \
                or not event_id.isprintable():
            raise InvalidRequestError("event_id", event_id, f"a string of 1 to {MAX_EVENT_ID_CHARS} printable "
                                      "characters")
        return Interaction(prompt=prompt, transition_chunks=int(k), event_id=event_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, or has events not yet returned by
        `step()`."""
        with self._lock:
            return bool(self._requests or self._pending)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the waiting and running requests."""
        with self._lock:
            return list(self._requests)

    def fail_unfinished(self, message: str) -> list[StreamEvent]:
        """Fail every unfinished request with `message` (used when the engine itself
        breaks); routes their final events and returns the unrouted pending ones."""
        with self._lock:
            requests = list(self._requests.values())
            for request in requests:
                self.scheduler.remove_waiting(request.request_id)
                self.scheduler.finish(request)
            self.executor.free([r.request_id for r in requests])
            for request in requests:
                self._close(request, RequestStatus.FAILED, error=RuntimeError(message))
            events, self._pending = self._pending, []
            return events

    def queue_position(self, request_id: str) -> int | None:
        """The 1-based place of a waiting request in the waiting queue (1 = admitted next;
        admission is first-come-first-served), or None when it is not waiting (running,
        finished or unknown). Thread-safe."""
        with self._lock:
            for position, request in enumerate(self.scheduler.waiting, start=1):
                if request.request_id == request_id:
                    return position
        return None

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self.scheduler.waiting)

    @property
    def num_running_rows(self) -> int:
        """Denoiser rows held by running requests (guidance branches count)."""
        return self.scheduler.running_rows

    def stats(self) -> dict[str, Any]:
        """Executor counters (acceleration, non-finite outputs, workers alive, offload), plus
        ``memory_budget`` (`MemoryBudget.stats`) with ``max_memory``, ``sleep_level`` and
        ``quantization`` (the quantized components, `ModelInfo.quantization`; None without)."""
        stats = dict(self.executor.stats())
        stats["quantization"] = self.model_info.quantization
        if self.memory_budget is not None:
            stats["memory_budget"] = self.memory_budget.stats(self.scheduler.running_memory)
        stats["sleep_level"] = self._sleep_level
        return stats

    # ----------------------------------------------------------------------- one step
    def step(self) -> list[StreamEvent]:
        """Advance the engine: collect background work, admit, run ONE denoising step, submit
        decodes; returns the events of requests without a listener. Blocks while another
        thread is stepping."""
        with self._step_lock:
            self._step_locked()
        with self._lock:
            events, self._pending = self._pending, []
            self._mail.notify_all()
            return events

    def _step_locked(self) -> None:
        with self._lock:
            self._apply_aborts()
            admitted = self.scheduler.admit()
            for request in admitted:
                request.phase = Phase.PREPARING
                request.status = RequestStatus.RUNNING
                request.metrics.queue_s = time.perf_counter() - request.arrival_time
                self._emit([StreamEvent(request.request_id, EventType.STARTED, step=0, total=request.num_steps)])
        if admitted:
            new = [NewRequest(r.request_id, r.prompt, r.params, r.inputs) for r in admitted]
            self._prepare_work.append((self.executor.submit_prepare(new), [r.request_id for r in admitted]))
        self._collect(block=False)
        with self._lock:
            self._apply_aborts()
            batch = self.scheduler.select_batch()
        if not batch and (self._prepare_work or self._decode_work or self._chunk_work):
            # nothing to step: wait for background work instead of spinning
            self._collect(block=True)
            with self._lock:
                self._apply_aborts()
                batch = self.scheduler.select_batch()
        if batch:
            self._denoise_step(batch)
            self._collect(block=False)

    def _apply_aborts(self) -> None:
        """Abort running requests that asked for it (lock held). Requests being prepared or
        decoded are closed when their work comes back."""
        if not self._aborting:
            return
        asked = sorted((self._requests[i] for i in self._aborting if i in self._requests), key=lambda r: r.seq)
        for request in asked:
            if request.phase in (Phase.PREPARING, Phase.DECODING, Phase.BETWEEN_CHUNKS):
                continue
            self.scheduler.remove_waiting(request.request_id)
            self.scheduler.finish(request)
            self.executor.free([request.request_id])
            self._close(request, RequestStatus.ABORTED)

    def _collect(self, block: bool) -> None:
        """Apply finished prepare/decode work; with `block`, wait (briefly) for at least one.
        A work item that raised as a whole (an executor fault, e.g. a dead worker) fails its
        requests."""
        if not (self._prepare_work or self._decode_work or self._chunk_work):
            return
        if block:
            wait([f for f, _ in self._prepare_work + self._decode_work + self._chunk_work], timeout=_WAIT_S,
                 return_when=FIRST_COMPLETED)
        for queue, apply in ((self._prepare_work, self._on_prepared), (self._decode_work, self._on_decoded),
                             (self._chunk_work, self._on_chunk)):
            for item in [w for w in queue if w[0].done()]:
                queue.remove(item)
                future, ids = item
                try:
                    results = future.result()
                except Exception as exc:  # noqa: BLE001
                    logger.exception("background work for %s failed", ids)
                    self._fail(ids, exc)
                    continue
                apply(results)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        with self._lock:
            for request_id in request_ids:
                request = self._requests.get(request_id)
                if request is not None:
                    self.scheduler.finish(request)
                    self.executor.free([request_id])
                    self._close(request, RequestStatus.FAILED, error=error)

    def _on_prepared(self, results: list[Prepared]) -> None:
        with self._lock:
            for result in results:
                request = self._requests.get(result.request_id)
                if request is None:  # failed or closed meanwhile
                    self.executor.free([result.request_id])
                    continue
                request.metrics.encode_s = result.seconds
                request.metrics.offload_loads += result.offload_loads
                request.prompt_truncated = result.prompt_truncated
                request.negative_prompt_truncated = result.negative_prompt_truncated
                if result.error is not None:  # an abort asked meanwhile wins, as for decode and chunks
                    self.scheduler.finish(request)
                    if request.abort_requested:
                        self._close(request, RequestStatus.ABORTED)
                    else:
                        self._close(request, RequestStatus.FAILED, error=result.error)
                    continue
                request.num_steps = result.num_steps
                request.step_key = result.step_key
                request.phase = Phase.DENOISING
                self.scheduler.changed()
                if request.abort_requested:
                    self._apply_aborts()

    def _on_decoded(self, results: list[Decoded]) -> None:
        with self._lock:
            for result in results:
                request = self._requests.get(result.request_id)
                if request is None:
                    continue
                request.metrics.offload_loads += result.offload_loads
                if result.preview:
                    if result.error is None and not request.abort_requested:
                        self._emit([StreamEvent(request.request_id, EventType.PARTIAL, step=result.step,
                                                total=request.num_steps, preview=result.output)])
                    continue
                self.scheduler.finish(request)
                if request.abort_requested:
                    self._close(request, RequestStatus.ABORTED)
                elif result.error is not None:
                    self._close(request, RequestStatus.FAILED, error=result.error)
                else:
                    request.metrics.decode_s = result.seconds
                    self._close(request, RequestStatus.FINISHED, images=result.output)

    def _on_chunk(self, results: list[ChunkDone]) -> None:
        now = time.perf_counter()
        with self._lock:
            for result in results:
                request = self._requests.get(result.request_id)
                if request is None:
                    self.executor.free([result.request_id])
                    continue
                request.metrics.offload_loads += result.offload_loads
                request.metrics.decode_s += result.seconds
                if request.abort_requested or result.error is not None:
                    self.scheduler.finish(request)
                    self.executor.free([request.request_id])
                    if request.abort_requested:
                        self._close(request, RequestStatus.ABORTED)
                    else:
                        self._close(request, RequestStatus.FAILED, error=result.error)
                    continue
                request.metrics.chunk_s.append(now - request.arrival_time)
                self._emit([StreamEvent(request.request_id, EventType.CHUNK, chunk_index=result.chunk_index,
                                        output=result.frames, event_ids=list(result.event_ids))])
                if result.video is not None:
                    self.scheduler.finish(request)
                    self._close(request, RequestStatus.FINISHED, images=[result.video])
                    continue
                request.chunk_index = result.chunk_index + 1
                request.num_steps = result.num_steps
                request.steps_done = 0
                request.step_key = result.step_key
                request.phase = Phase.DENOISING
                self.scheduler.changed()

    def _denoise_step(self, batch: list[Request]) -> None:
        """ONE denoising step of `batch`, booked on the current `StepRun` (a new one when the
        batch changed); each request's own bookkeeping (finish, preview, failure, step key)
        only at the steps where the run says some request needs it (`StepRun.until`) or the
        executor reported something about single requests."""
        start = time.perf_counter()
        run = self._run
        if run is None or run.batch is not batch:
            self._end_run()
            run = self._run = StepRun.start(batch, start)
        out = self.executor.step(run.ids)
        end = time.perf_counter()
        for listener in self._step_listeners:
            listener(out.num_rows, len(batch), end - start)
        with self._lock:
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
                self.scheduler.changed()
            self._after_steps(batch)

    def _end_run(self) -> None:
        """Fold the current `StepRun` into its requests (lock held or stepping thread)."""
        run, self._run = self._run, None
        if run is not None:
            run.fold()

    def _book_each(self, batch: list[Request], out, end: float) -> None:
        """Book one step request by request (lock held): the executor reported failures, forwards
        of each request's own, or steps done / totals of its own (the whole-request runner)."""
        errors, steps_done, num_steps, step_keys = out.errors, out.steps_done, out.num_steps, out.step_keys
        loads, peak, request_rows = out.offload_loads, out.peak_memory_bytes, out.request_rows
        stepped, events, keys_moved = [], [], False
        for request in batch:
            request_id = request.request_id
            if errors and request_id in errors:
                self.scheduler.finish(request)
                self._close(request, RequestStatus.FAILED, error=errors[request_id])
                continue
            m = request.metrics
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
            self.scheduler.changed()
        self._after_steps(stepped)

    def _after_steps(self, requests: list[Request]) -> None:
        """Requests whose steps are booked (lock held): those done denoising go to decode (or
        to their chunk boundary), those at a preview step get a preview decode."""
        finished, previews, chunks = [], [], []
        for request in requests:
            done = request.steps_done
            if done >= request.num_steps:
                if request.streaming:
                    request.phase = Phase.BETWEEN_CHUNKS
                    chunks.append(ChunkWork(request.request_id, request.interactions))
                    request.interactions = []
                else:
                    request.phase = Phase.DECODING
                    finished.append(request.request_id)
            elif request.preview_steps and done in request.preview_steps and not request.abort_requested:
                previews.append(request.request_id)
        if finished or chunks:
            self.scheduler.changed()
        if previews:
            self._decode_work.append((self.executor.submit_decode(previews, preview=True), previews))
        if finished:
            self._decode_work.append((self.executor.submit_decode(finished), finished))
        for work in chunks:  # one item each: a stream steps again as soon as its own boundary is done
            self._chunk_work.append((self.executor.submit_chunk([work]), [work.request_id]))

    def _close(self, request: Request, status: RequestStatus, images=None,
               error: BaseException | WorkError | None = None) -> None:
        """Close a request: fill metrics, emit its final event, forget it (lock held)."""
        if request.phase is Phase.DENOISING:  # it may be stepping in the current run: book it first
            self._end_run()
        request.status = status
        request.phase = Phase.DONE
        m = request.metrics
        m.total_s = time.perf_counter() - request.arrival_time
        m.peak_memory_bytes = self.executor.peak_memory_bytes()
        if error is None:
            message = None
        elif isinstance(error, WorkError):
            message = str(error)
        else:
            message = f"{type(error).__name__}: {error}"
        is_video = self.spec.default_num_frames is not None
        media = images if images is not None else []
        output = GenerationOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            images=[] if is_video else media,
            videos=media if is_video else [],
            seed=request.params.seed,
            status=status,
            metrics=m,
            prompt_truncated=request.prompt_truncated,
            negative_prompt_truncated=request.negative_prompt_truncated,
            error=message,
            error_type=error.type if isinstance(error, WorkError) else (
                type(error).__name__ if error is not None else None),
            params=request.params,
        )
        event_type = {RequestStatus.FINISHED: EventType.FINISHED, RequestStatus.FAILED: EventType.FAILED,
                      RequestStatus.ABORTED: EventType.ABORTED}[status]
        self._emit([StreamEvent(request.request_id, event_type, output=output, error=message)])
        self._requests.pop(request.request_id, None)
        self._aborting.discard(request.request_id)
        self._ended[request.request_id] = None
        while len(self._ended) > _ENDED_IDS:
            self._ended.popitem(last=False)

    def _emit(self, events: list[StreamEvent]) -> None:
        """Route events (lock held): to their request's listener, else to `step()`'s return;
        then wake the threads waiting in `generate` (once per call, not per event)."""
        delivered = False
        for event in events:
            request = self._requests.get(event.request_id)
            listener = request.listener if request is not None else None
            if listener is None:
                self._pending.append(event)
            else:
                delivered = True
                try:
                    listener(event)
                except Exception:  # noqa: BLE001 - a consumer's bug must not break the engine
                    logger.exception("event listener for %s raised", event.request_id)
        if delivered:
            self._mail.notify_all()

    # -------------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        inputs: Any = None,
    ) -> list[GenerationOutput]:
        """Generate images for `prompts` (one request each) and wait for all of them.

        Safe to call from several threads at once on one engine: their requests share steps,
        and each call gets exactly its own outputs.

        Args:
            prompts: one prompt or a list.
            params: one `SamplingParams` for all, or one per prompt.
            on_event: called with every event of these requests (e.g. for a progress bar), on
                the calling thread.
            inputs: input images for all prompts (one image, or a `RequestInputs` made with
                `diffserve.core.inputs.make_inputs` for several images / a mask), or a list or tuple
                with one such entry (or None) per prompt.

        Returns:
            One `GenerationOutput` per prompt, in order; a request that failed has
            ``status == "failed"`` and its `error` set (the others are unaffected).

        Raises:
            InvalidRequestError: any prompt or params invalid, or a request alone exceeds
                ``max_memory`` (nothing is queued then).
            EngineSleepingError: the engine is asleep or going to sleep.
        """
        self._check_awake()
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts", prompts, "a string or a non-empty list of strings")
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            if not isinstance(params, Sequence) or isinstance(params, str) \
                    or not all(isinstance(p, SamplingParams) for p in params):
                raise InvalidRequestError("params", params, "a SamplingParams or a list of them")
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    "params", f"{len(params_list)} items", f"one SamplingParams or {len(prompts)} (one per prompt)"
                )
        inputs_list = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs] * len(prompts)
        if len(inputs_list) != len(prompts):
            raise InvalidRequestError("inputs", f"{len(inputs_list)} items", f"one per prompt ({len(prompts)})")
        spec = self.spec
        inputs_list = [make_inputs(x) if x is not None else None for x in inputs_list]
        for prompt, p, x in zip(prompts, params_list, inputs_list):  # validate before queueing
            validate_prompt(prompt, spec)
            resolved = p.resolve(spec, self.config.limits, 0)
            plan = self.executor.plan(resolved, x)
            if self.memory_budget is not None:
                self.memory_budget.check(resolved, plan.rows)
        mailbox: list[StreamEvent] = []

        def deliver(event: StreamEvent) -> None:
            mailbox.append(event)  # the lock is held by the emitting thread; `_emit` then wakes waiters

        ids: list[str] = []
        try:
            for prompt, p, x in zip(prompts, params_list, inputs_list):
                ids.append(self.add_request(prompt, p, inputs=x, listener=deliver, progress=on_event is not None))
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        outputs: dict[str, GenerationOutput] = {}
        try:
            while len(outputs) < len(ids):
                got = []
                if mailbox:  # (read without the lock: appends only happen under it, and are seen next time)
                    with self._lock:
                        got, mailbox[:] = list(mailbox), []
                for event in got:
                    if on_event is not None:
                        on_event(event)
                    if event.type.is_final:
                        outputs[event.request_id] = event.output
                if len(outputs) == len(ids):
                    break
                self._step_or_wait(lambda: not mailbox)
        except BaseException:
            for request_id in ids:
                if request_id not in outputs:
                    self.abort(request_id)
            raise
        return [outputs[i] for i in ids]

    def _step_or_wait(self, nothing_new: Callable[[], bool]) -> None:
        """Step if no other thread is stepping; else wait (briefly) for the stepping thread's
        events while `nothing_new()` holds (called with the lock held)."""
        if self._step_lock.acquire(blocking=False):
            try:
                self._step_locked()
            finally:
                self._step_lock.release()
            with self._lock:
                self._mail.notify_all()
        else:
            with self._lock:
                if nothing_new():
                    self._mail.wait(timeout=_WAIT_S)

    def shutdown(self) -> None:
        """Stop the executor's background work."""
        self.executor.shutdown()

