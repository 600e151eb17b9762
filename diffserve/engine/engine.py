"""`DiffusionEngine`: the synchronous engine (offline API), a thin facade over its parts.

- `InputProcessor` (`input_processor.py`): a prompt, params and inputs become checked,
  resolved and planned `ProcessedRequest` s (seeds, parameters, inputs, plans).
- `RequestScheduler` (`scheduler.py`): the request lifecycle; each tick ``schedule()`` returns
  ONE plain `SchedulerOutput` and ``update_from_output()`` applies the workers' results.
- the executor (`diffserve.executor`): ONE ``execute(scheduler_output)`` call per tick runs it on
  the workers (the step synchronously; prepare, decode, previews and chunk boundaries beside
  the steps) and returns the step's outcome with the background work that completed.
- `SleepMode` (`sleep_mode.py`): sleep and wake up.

One `step()` call is one tick (two when the first stepped nothing and made a batch ready, e.g.
requests whose prepare came back): at most ONE denoising step. The engine holds plain data only;
tensors live in the executor's workers.

Streams (``SamplingParams.num_chunks``): a stream whose chunk finished denoising keeps its rows
and its state in the worker; its chunk boundary (`ChunkWork`: decode the chunk, prepare the
next one, conditioned on it) runs in the background like a decode, and the stream comes back to
the request scheduler, with the same batch key, for its next chunk. Each chunk is emitted as a
``chunk`` event as soon as it is decoded; the last one also finishes the request with the whole
video. `submit_interaction` changes the prompt of a running stream's following chunks; the
interaction travels to the workers with the next chunk boundary.

Multi-stage models (`ModelInfo.ar_stage`: an autoregressive stage before the DiT, e.g. the
built-in ``digits-reasoning``, GLM-Image): the engine also owns the AR stage client
(`diffserve.executor.ar_stage`: on threads of this process sharing the in-process runner's
connector, or in its own process putting into shared memory when the DiT stage runs in worker
processes); the request scheduler submits each request to it first (see its docstring).

Memory: with ``EngineConfig.max_memory`` the request scheduler also admits by estimated memory
(`diffserve.engine.memory_budget`); `sleep` / `wake_up` give the device's memory back between
bursts (vLLM's levels 1 and 2).

Threads: any number of threads may call `generate`, `add_request`, `abort` and `step` on one
engine. One thread steps at a time; each request's events go to its owner (the `generate` call
or async consumer that added it, via its listener) whichever thread stepped, and the events of
requests without a listener are returned by `step()`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from diffserve.config import EngineConfig
from diffserve.core.errors import InvalidRequestError
from diffserve.core.messages import ModelInfo
from diffserve.core.outputs import GenerationOutput, StreamEvent
from diffserve.core.sampling_params import ModelSpec, SamplingParams
from diffserve.engine.input_processor import InputProcessor, ProcessedRequest
from diffserve.engine.loras import EngineLoras, LoraRegistry
from diffserve.engine.queues import RequestQueues
from diffserve.engine.scheduler import RequestScheduler
from diffserve.engine.sleep_mode import SleepMode
from diffserve.executor import Executor, InProcessExecutor, build_ar_stage, build_executor
from diffserve.models import builtin_loras

logger = logging.getLogger(__name__)

#: Longest a thread waiting in `generate` blocks for the stepping thread's events (seconds).
_WAIT_S = 0.05


class DiffusionEngine:
    """Synchronous diffusion serving engine (offline API); implements
    `diffserve.engine.client.EngineClient`.

    Args:
        config: engine configuration; None = defaults (the built-in model on the best device).
        runner: an already-built runner to reuse (optional; in-process executor).
        executor: an already-built executor (optional; overrides `runner`).

    Attributes:
        input_processor: the `InputProcessor` every entrypoint builds its requests with.
        scheduler / executor: the request scheduler and the executor (for tests and
            benchmarks; entrypoints use the engine client's methods only).

    Example:
        >>> engine = DiffusionEngine(EngineConfig())
        >>> [out] = engine.generate("a handwritten digit 7", SamplingParams(seed=0))
        >>> out.images[0].save("seven.png")
    """

    def __init__(self, config: EngineConfig | None = None, runner=None, executor: Executor | None = None):
        self.config = config or EngineConfig()
        if executor is None:
            self.config.model_path  # a Hub id is fetched here, once, before any worker starts
            executor = InProcessExecutor(self.config, runner) if runner is not None else build_executor(self.config)
        self.executor = executor
        self.model_info: ModelInfo = executor.info()
        #: memory-aware admission (None without ``max_memory``)
        self.memory_budget = None
        if self.config.max_memory is not None:
            from diffserve.engine.memory_budget import MemoryBudget

            self.memory_budget = MemoryBudget.from_config(self.config.max_memory, executor.memory_profile())
        self._lock = threading.RLock()
        self._mail = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self.input_processor = InputProcessor(self.model_info.spec, self.config.limits, self.config.default_seed,
                                              executor.plan, self.memory_budget)
        #: LoRA adapters: names, paths, loads into the workers (`diffserve.engine.loras`)
        self.loras = EngineLoras(LoraRegistry(self.config.lora_dir, builtin_loras(self.config.model),
                                              self.config.max_loras, self.config.cpu_lora_capacity), executor)
        queues = RequestQueues(self.config.max_batch_size, self.config.max_waiting_requests,
                               self.config.execution_mode,
                               memory_limit=self.memory_budget.available if self.memory_budget is not None else None,
                               max_loras=self.config.max_loras, lora_ready=self.loras.ready,
                               policy=self.config.scheduling_policy, aging_s=self.config.aging_s,
                               max_padding_ratio=self.config.max_padding_ratio,
                               padding_free=self.model_info.padding_free)
        #: multi-stage models: the AR stage client (None for single-stage models)
        self.ar_stage = build_ar_stage(self.config, executor) if self.model_info.ar_stage else None
        self.scheduler = RequestScheduler(queues, self.model_info, executor.peak_memory_bytes,
                                          notify=self._mail.notify_all, ar_stage=self.ar_stage,
                                          admission=self.config.admission)
        self.sleep_mode = SleepMode(executor, self._lock, self._step_lock, self._drain)
        self._step_listeners: list[Callable[[int, int, float], None]] = []
        for name, path in self.config.loras.items():  # --lora NAME=PATH: loaded before serving
            self.load_lora(name, path, origin="startup")

    # ------------------------------------------------------------------ model facts
    @property
    def spec(self) -> ModelSpec:
        """The loaded model's `ModelSpec` (defaults and limits)."""
        return self.model_info.spec

    @property
    def runner(self):
        """The in-process `Runner` (in-process executor only; None otherwise). For tests and
        benchmarks."""
        return self.executor.runner

    # ------------------------------------------------------------------ request lifecycle
    def add_request(
        self,
        prompt: str | ProcessedRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        preview_steps: Sequence[int] = (),
        inputs: Any = None,
        listener: Callable[[StreamEvent], None] | None = None,
        progress: bool = True,
    ) -> str:
        """Queue one request; returns its id (a fresh uuid when not given).

        Args:
            prompt: the prompt, or a request the `input_processor` already processed (then
                `params` and `inputs` stay None).
            params: sampling params (None: the model's defaults).
            preview_steps: denoising steps (1-based, counting the steps the request runs: with
                image-to-image strength < 1 fewer than ``num_inference_steps``) after which a
                decoded preview of the current latents is emitted as a `partial` event.
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
        self.sleep_mode.check_awake()
        processed = self._processed(prompt, params, inputs)
        with self._lock:
            self.sleep_mode.check_awake()
            self.loras.check(processed.params.loras)  # unknown names refused; adapters not held start loading
            return self.scheduler.add_request(processed, request_id, preview_steps, listener, progress)

    def _processed(self, prompt: str | ProcessedRequest, params: SamplingParams | None,
                   inputs: Any) -> ProcessedRequest:
        if isinstance(prompt, ProcessedRequest):
            if params is not None or inputs is not None:
                raise InvalidRequestError("params", params if params is not None else "<inputs>",
                                          "None with a processed request (its params and inputs are in it)")
            return prompt
        return self.input_processor.process(prompt, params, inputs)[0]

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request. A waiting one leaves the queue at once; a
        running one stops at the next step boundary and frees its latents (a stream between
        two chunks: when its chunk boundary work comes back, without emitting that chunk). Its
        final event (`aborted`) comes out of the next `step()`. Returns False if unknown or
        done."""
        with self._lock:
            return self.scheduler.abort(request_id)

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
        checked = self.input_processor.process_interaction(interaction)
        with self._lock:
            return self.scheduler.submit_interaction(request_id, checked)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, has events not yet returned by
        `step()`, or has worker state still to free."""
        with self._lock:
            return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the waiting and running requests."""
        with self._lock:
            return list(self.scheduler.requests)

    def fail_unfinished(self, message: str) -> list[StreamEvent]:
        """Fail every unfinished request with `message` (used when the engine itself
        breaks); routes their final events and returns the unrouted pending ones."""
        with self._lock:
            self.scheduler.fail_all(message)
            return self.scheduler.take_events()

    # ------------------------------------------------------------------ counts and stats
    def queue_position(self, request_id: str) -> int | None:
        """The 1-based place of a waiting request in the waiting queue (1 = admitted next;
        admission is first-come-first-served), or None when it is not waiting (running,
        finished or unknown). Thread-safe."""
        with self._lock:
            return self.scheduler.queue_position(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """Admitted requests (being prepared, denoising, between chunks or being decoded)."""
        return self.scheduler.num_running

    @property
    def num_running_rows(self) -> int:
        """Denoiser rows held by running requests (guidance branches count)."""
        return self.scheduler.num_running_rows

    def stats(self) -> dict[str, Any]:
        """Executor counters (acceleration, non-finite outputs, workers alive, offload), plus
        ``memory_budget`` (`MemoryBudget.stats`) with ``max_memory``, ``sleep_level``,
        ``quantization`` (the quantized components, `ModelInfo.quantization`; None without), and for
        multi-stage models ``ar_stage`` (the AR stage's counters and its connector's accounting)
        and ``payloads`` (the DiT side's receiver)."""
        stats = dict(self.executor.stats())
        stats["scheduler"] = self.scheduler.stats()
        stats["quantization"] = self.model_info.quantization
        if self.memory_budget is not None:
            queues = self.scheduler.queues
            stats["memory_budget"] = self.memory_budget.stats(queues.running_memory, queues.padding_bytes)
        stats["sleep_level"] = self.sleep_mode.level
        if self.ar_stage is not None:
            stats["ar_stage"] = self.ar_stage.stats()
        return stats

    def add_step_listener(self, listener: Callable[[int, int, float], None]) -> None:
        """Call ``listener(num_rows, num_requests, seconds)`` after every denoising step
        (on the stepping thread): denoiser rows in the forward (guidance branches included),
        requests in the batch, and the step's wall-clock duration in seconds."""
        self._step_listeners.append(listener)

    @property
    def is_running(self) -> bool:
        """The workers can run work (False once one died)."""
        return self.executor.dead is None

    @property
    def error(self) -> str | None:
        """Why the engine can no longer run (a worker died), or None while healthy."""
        return self.executor.dead

    # ------------------------------------------------------------------ sleep mode
    @property
    def is_sleeping(self) -> bool:
        """The engine is asleep (its weights are off the device or discarded)."""
        return self.sleep_mode.is_sleeping

    @property
    def sleep_state(self) -> str:
        """``"awake"``, ``"draining"`` (going to sleep) or ``"asleep"``."""
        return self.sleep_mode.state

    @property
    def sleep_level(self) -> int | None:
        """1 or 2 while asleep, None while awake."""
        return self.sleep_mode.level

    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (see `SleepMode.sleep`): new requests are refused from now
        on, the ones already added run to their end, then the weights leave the device
        (level 1) or are discarded (level 2). Blocks until asleep.

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
        """
        self.sleep_mode.sleep(level)

    def wake_up(self) -> None:
        """Restore the weights and admit requests again (no-op while awake)."""
        self.sleep_mode.wake_up()

    def _drain(self) -> None:
        """Step (or wait for the thread that steps) until no request or worker state is held."""
        while True:
            with self._lock:
                if not self.scheduler.has_requests():
                    return
            self._step_or_wait(self.scheduler.has_requests)

    # ----------------------------------------------------------------------- one step
    def step(self) -> list[StreamEvent]:
        """Advance the engine by one tick (see the module docstring): at most ONE denoising
        step, with the admissions, background work and results around it; returns the events
        of requests without a listener. Blocks while another thread is stepping."""
        with self._step_lock:
            self._step_locked()
        with self._lock:
            events = self.scheduler.take_events()
            self._mail.notify_all()
            return events

    def _step_locked(self) -> None:
        scheduler, executor = self.scheduler, self.executor
        ar_futures = None
        for _ in range(2):
            with self._lock:
                self._poll_loras()
                out = scheduler.schedule()
            if not (out.step_ids or out.has_work):
                loads = self.loras.in_flight()
                if loads:  # only adapter loads to wait for: wait (briefly) instead of spinning
                    wait(loads, timeout=_WAIT_S, return_when=FIRST_COMPLETED)
            result = executor.execute(out)
            if result.step is not None and self._step_listeners:
                seconds = result.step_end - result.step_start
                for listener in self._step_listeners:
                    listener(result.step.num_rows, len(out.step_ids), seconds)
            with self._lock:
                scheduler.update_from_output(out, result)
                # nothing stepped, but results made a batch ready (e.g. prepared requests): step now
                if out.step_ids or not scheduler.has_batch():
                    ar_futures = scheduler.ar_futures() if not out.step_ids and not executor.busy else None
                    break
        if ar_futures:  # only the AR stage is at work: wait (briefly) for it instead of spinning
            wait(ar_futures, timeout=_WAIT_S, return_when=FIRST_COMPLETED)

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

    # -------------------------------------------------------------------- LoRA adapters
    def _loras_in_use(self) -> set[str]:
        """Names of the adapters waiting or running requests use (lock held)."""
        return {name for r in self.scheduler.requests.values() for name in r.lora_names}

    def _poll_loras(self) -> None:
        """Apply finished adapter loads and the host budget (lock held); fail the waiting
        requests of a failed load."""
        if not self.loras.needs_poll():
            return
        failed = self.loras.poll(self._loras_in_use())
        if not failed:
            return
        for request in [r for r in self.scheduler.queues.waiting if set(r.lora_names) & set(failed)]:
            name = next(n for n in request.lora_names if n in failed)
            self.scheduler.fail_waiting(request.request_id, InvalidRequestError(
                "loras", dict(request.params.loras), "LoRA adapters that load",
                detail=f"loading {name!r} failed: {failed[name]}"))

    def check_loras(self, loras: Mapping[str, float] | None) -> None:
        """Check a request's ``loras`` names (what `add_request` does first; for callers that
        validate before queueing) and start loading the adapters the workers do not hold.

        Raises:
            InvalidRequestError: (field ``loras``) an unknown name, or more adapters than
                ``max_loras``.
        """
        with self._lock:
            self.loras.check(loras)

    def load_lora(self, name: str, path: str | os.PathLike, origin: str = "api",
                  within_lora_dir: bool = False) -> dict[str, Any]:
        """Load the LoRA adapter at `path` (any format diffusers reads) as `name`, replacing an
        adapter of that name that no request uses; blocks until every worker holds it. Steps
        go on meanwhile (another thread may step).

        Args:
            within_lora_dir: `path` must lie inside ``lora_dir`` (relative paths are taken from
                it): what the HTTP server allows its clients.

        Returns:
            Its listing entry (`list_loras`).

        Raises:
            InvalidRequestError: (field ``name``) a bad name; (field ``path``) the file is
                missing, unreadable, of an unsupported kind, does not match the model, or its rank
                exceeds ``max_lora_rank``.
            LoraInUseError: requests use the adapter it would replace, or it is loading.
        """
        if within_lora_dir:
            path = self.loras.registry.inside_lora_dir(path)
        with self._lock:
            previous = self.loras.registry.entries.get(name)
            future = self.loras.begin_load(name, os.fspath(path), origin, self._loras_in_use())
        try:
            future.result()
        except Exception:
            with self._lock:
                self._poll_loras()  # requests that named the new adapter meanwhile fail
                self.loras.keep_after_failed_load(name, previous)
            raise
        finally:
            with self._lock:
                self._poll_loras()
        with self._lock:
            return self.loras.registry.entries[name].as_dict()

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name` from the workers.

        Raises:
            InvalidRequestError: (field ``name``) no such adapter.
            LoraInUseError: waiting or running requests use it (unload once they finish).
        """
        with self._lock:
            self.loras.unload(name, self._loras_in_use())

    def list_loras(self) -> list[dict[str, Any]]:
        """Every registered adapter: ``name``, ``path``, ``origin`` (startup, api, lora_dir,
        builtin), ``state`` (registered: known, not in the workers; loading; ready; failed,
        with ``error``), ``in_use`` (waiting + running requests naming it) and, once read,
        ``format``, ``rank``, ``modules`` (per component) and ``bytes``."""
        with self._lock:
            counts: dict[str, int] = {}
            for r in self.scheduler.requests.values():
                for n in r.lora_names:
                    counts[n] = counts.get(n, 0) + 1
            return [{**entry, "in_use": counts.get(entry["name"], 0)} for entry in self.loras.registry.listing()]

    # -------------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: str | ProcessedRequest | Sequence[str] | Sequence[ProcessedRequest],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        inputs: Any = None,
    ) -> list[GenerationOutput]:
        """Generate for `prompts` (one request each) and wait for all of them.

        Safe to call from several threads at once on one engine: their requests share steps,
        and each call gets exactly its own outputs.

        Args:
            prompts: one prompt or a list; or requests the `input_processor` already processed
                (then `params` and `inputs` stay None).
            params: one `SamplingParams` for all, or one per prompt.
            on_event: called with every event of these requests (e.g. for a progress bar), on
                the calling thread.
            inputs: input images for all prompts (one image, or a `RequestInputs` made with
                `diffserve.core.inputs.make_inputs` for several images / a mask), or a list or
                tuple with one such entry (or None) per prompt.

        Returns:
            One `GenerationOutput` per prompt, in order; a request that failed has
            ``status == "failed"`` and its `error` set (the others are unaffected).

        Raises:
            InvalidRequestError: any prompt or params invalid, or a request alone exceeds
                ``max_memory`` (nothing is queued then).
            EngineSleepingError: the engine is asleep or going to sleep.
        """
        self.sleep_mode.check_awake()
        requests = self._process_all(prompts, params, inputs)  # every check before anything is queued
        mailbox: list[StreamEvent] = []

        def deliver(event: StreamEvent) -> None:
            mailbox.append(event)  # the lock is held by the emitting thread; the scheduler then wakes waiters

        ids: list[str] = []
        try:
            for request in requests:
                ids.append(self.add_request(request, listener=deliver, progress=on_event is not None))
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

    def _process_all(self, prompts, params, inputs) -> list[ProcessedRequest]:
        """`generate`'s arguments as processed requests (see `generate`)."""
        if isinstance(prompts, (str, ProcessedRequest)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts", prompts, "a string or a non-empty list of strings")
        prompts = list(prompts)
        if all(isinstance(p, ProcessedRequest) for p in prompts):
            return [self._processed(p, None if params is None else params, inputs) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
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
        return [self._processed(prompt, p, x) for prompt, p, x in zip(prompts, params_list, inputs_list)]

    def shutdown(self) -> None:
        """Stop the executor's background work (and a multi-stage model's AR stage)."""
        if self.ar_stage is not None:
            self.ar_stage.shutdown()
        self.executor.shutdown()
