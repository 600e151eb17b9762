"""`DiffusionEngine`: the request lifecycle (add, step, abort, finish) on one model runner.

One `step()` call: apply aborts, admit and prepare new requests, run ONE denoising step for
the batch the request scheduler picks, decode the requests that just finished, and return
the events that happened. `generate()` is the offline API: add requests, step until done.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from diffserve.config import EngineConfig
from diffserve.engine.request import Request
from diffserve.engine.scheduler import RequestScheduler
from diffserve.errors import InvalidRequestError
from diffserve.outputs import (
    EventType,
    GenerationOutput,
    RequestStatus,
    StreamEvent,
)
from diffserve.pipelines.base import RequestState, request_rows
from diffserve.runner.model_runner import ModelRunner
from diffserve.sampling_params import SamplingParams, validate_prompt

logger = logging.getLogger(__name__)


class DiffusionEngine:
    """Synchronous diffusion serving engine (offline API).

    Args:
        config: engine configuration; None = defaults (the built-in model on the best device).
        runner: an already-built `ModelRunner` to reuse (optional).

    Example:
        >>> engine = DiffusionEngine(EngineConfig())
        >>> [out] = engine.generate("a handwritten digit 7", SamplingParams(seed=0))
        >>> out.images[0].save("seven.png")
    """

    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None):
        self.config = config or EngineConfig()
        self.runner = runner or ModelRunner(self.config)
        self.scheduler = RequestScheduler(
            self.config.max_batch_size, self.config.max_waiting_requests, self.config.execution_mode
        )
        self._lock = threading.RLock()
        self._requests: dict[str, Request] = {}
        self._pending: list[StreamEvent] = []
        self._seq = itertools.count()
        self._step_listeners: list[Callable[[int, int, float], None]] = []

    def add_step_listener(self, listener: Callable[[int, int, float], None]) -> None:
        """Call ``listener(num_rows, num_requests, seconds)`` after every denoising step
        (on the engine thread): transformer rows in the forward (CFG rows included), requests
        in the batch, and the step's wall-clock duration in seconds."""
        self._step_listeners.append(listener)

    # ----------------------------------------------------------------- request lifecycle
    def add_request(
        self,
        prompt: str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        preview_steps: Sequence[int] = (),
    ) -> str:
        """Validate and queue one request; returns its id (a fresh uuid when not given).

        Args:
            preview_steps: denoising steps (1-based) after which a decoded preview of the
                current latents is emitted as a `partial` event.

        Raises:
            InvalidRequestError: a field is invalid (named in the message).
            EngineOverloadedError: the waiting queue is full.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", params, "a SamplingParams")
        spec = self.runner.spec
        prompt = validate_prompt(prompt, spec)
        resolved = params.resolve(spec, self.config.limits, self.config.default_seed)
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=resolved,
            batch_key=self.runner.batch_key(resolved),
            rows=request_rows(resolved),
            seq=next(self._seq),
            arrival_time=time.perf_counter(),
            preview_steps=frozenset(int(s) for s in preview_steps),
        )
        request.metrics.arrival_time = time.time()
        with self._lock:
            if request.request_id in self._requests:
                raise InvalidRequestError("request_id", request.request_id, "unique among live requests")
            self.scheduler.add(request)
            self._requests[request.request_id] = request
            self._pending.append(StreamEvent(request.request_id, EventType.QUEUED))
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request. A waiting one leaves the queue at once; a
        running one stops at the next step boundary and frees its latents. Its final event
        (`aborted`) comes out of the next `step()`. Returns False if unknown or done."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.status.is_final:
                return False
            if self.scheduler.remove_waiting(request_id) is not None:
                # never started: free its queue slot now; the event goes out with the next step
                self._pending.append(self._final(request, RequestStatus.ABORTED))
            else:
                request.abort_requested = True
            return True

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
        breaks); returns their final events."""
        with self._lock:
            requests = list(self._requests.values())
            for request in requests:
                self.scheduler.remove_waiting(request.request_id)
                self.scheduler.finish(request)
        events = list(self._pending)
        self._pending = []
        events += [self._final(r, RequestStatus.FAILED, error=RuntimeError(message)) for r in requests]
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
        """Transformer rows held by running requests (CFG counts 2 per image)."""
        return self.scheduler.running_rows

    # ----------------------------------------------------------------------- one step
    def step(self) -> list[StreamEvent]:
        """Advance the engine by one denoising step; return the events that occurred."""
        with self._lock:
            events, self._pending = self._pending, []
            for request in [r for r in self._requests.values() if r.abort_requested]:
                self.scheduler.remove_waiting(request.request_id)
                self.scheduler.finish(request)
                events.append(self._final(request, RequestStatus.ABORTED))
            admitted = self.scheduler.admit()
        for request in admitted:
            events.extend(self._prepare(request))
        with self._lock:
            batch = self.scheduler.select_batch()
        if batch:
            events.extend(self._denoise_step(batch))
        return events

    def _prepare(self, request: Request) -> list[StreamEvent]:
        start = time.perf_counter()
        request.status = RequestStatus.RUNNING
        request.metrics.queue_s = start - request.arrival_time
        request.state = RequestState(request.request_id, request.prompt, request.params)
        events = [StreamEvent(request.request_id, EventType.STARTED,
                              step=0, total=request.params.num_inference_steps)]
        try:
            # tokenizers are not thread-safe: only the engine thread touches them
            request.prompt_truncated = self.runner.prompt_is_truncated(request.prompt)
            self.runner.prepare(request.state)
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            logger.exception("prepare failed for %s", request.request_id)
            with self._lock:
                self.scheduler.finish(request)
            events.append(self._final(request, RequestStatus.FAILED, error=exc))
            return events
        request.metrics.encode_s = time.perf_counter() - start
        return events

    def _denoise_step(self, batch: list[Request]) -> list[StreamEvent]:
        start = time.perf_counter()
        for request in batch:
            if request.first_step_time is None:
                request.first_step_time = start
        result = self.runner.execute_step([r.state for r in batch])
        end = time.perf_counter()
        for listener in self._step_listeners:
            listener(result.num_rows, len(batch), end - start)
        events: list[StreamEvent] = []
        for request in batch:
            error = result.failures.get(request.request_id)
            if error is not None:
                logger.error("step failed for %s: %r", request.request_id, error)
                with self._lock:
                    self.scheduler.finish(request)
                events.append(self._final(request, RequestStatus.FAILED, error=error))
                continue
            m = request.metrics
            m.num_steps += 1
            m.batch_sizes[result.num_rows] = m.batch_sizes.get(result.num_rows, 0) + 1
            m.denoise_s = end - request.first_step_time
            state = request.state
            events.append(StreamEvent(request.request_id, EventType.PROGRESS,
                                      step=state.step_index, total=state.num_steps))
            if state.done:
                events.append(self._decode(request))
            elif state.step_index in request.preview_steps:
                events.append(self._preview(request))
        return events

    def _preview(self, request: Request) -> StreamEvent:
        state = request.state
        try:
            preview = self.runner.decode(state)
        except Exception as exc:  # noqa: BLE001 - a preview failure is not fatal
            logger.warning("preview failed for %s: %r", request.request_id, exc)
            preview = None
        return StreamEvent(request.request_id, EventType.PARTIAL, step=state.step_index,
                           total=state.num_steps, preview=preview)

    def _decode(self, request: Request) -> StreamEvent:
        start = time.perf_counter()
        try:
            images = self.runner.decode(request.state)
        except Exception as exc:  # noqa: BLE001
            logger.exception("decode failed for %s", request.request_id)
            with self._lock:
                self.scheduler.finish(request)
            return self._final(request, RequestStatus.FAILED, error=exc)
        request.metrics.decode_s = time.perf_counter() - start
        with self._lock:
            self.scheduler.finish(request)
        return self._final(request, RequestStatus.FINISHED, images=images)

    def _final(self, request: Request, status: RequestStatus, images=None,
               error: BaseException | None = None) -> StreamEvent:
        """Close a request: release its tensors, fill metrics, build its final event."""
        request.status = status
        if request.state is not None:
            request.state.release()
        m = request.metrics
        m.total_s = time.perf_counter() - request.arrival_time
        m.peak_memory_bytes = self.runner.peak_memory_bytes()
        message = None if error is None else f"{type(error).__name__}: {error}"
        output = GenerationOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            images=images if images is not None else [],
            seed=request.params.seed,
            status=status,
            metrics=m,
            prompt_truncated=request.prompt_truncated,
            error=message,
        )
        with self._lock:
            self._requests.pop(request.request_id, None)
        event_type = {RequestStatus.FINISHED: EventType.FINISHED, RequestStatus.FAILED: EventType.FAILED,
                      RequestStatus.ABORTED: EventType.ABORTED}[status]
        return StreamEvent(request.request_id, event_type, output=output, error=message)

    # -------------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate images for `prompts` (one request each) and wait for all of them.

        Args:
            prompts: one prompt or a list.
            params: one `SamplingParams` for all, or one per prompt.
            on_event: called with every event of these requests (e.g. for a progress bar).

        Returns:
            One `GenerationOutput` per prompt, in order; a request that failed has
            ``status == "failed"`` and its `error` set (the others are unaffected).

        Raises:
            InvalidRequestError: any prompt or params invalid (nothing is queued then).
        """
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
        spec = self.runner.spec
        for prompt, p in zip(prompts, params_list):  # validate everything before queueing
            validate_prompt(prompt, spec)
            p.resolve(spec, self.config.limits, 0)
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params_list)]
        wanted = set(ids)
        outputs: dict[str, GenerationOutput] = {}
        while len(outputs) < len(ids):
            for event in self.step():
                if event.request_id not in wanted:
                    continue
                if on_event is not None:
                    on_event(event)
                if event.type.is_final:
                    outputs[event.request_id] = event.output
        return [outputs[i] for i in ids]
