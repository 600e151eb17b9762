"""`AsyncDiffusionEngine`: the engine loop in a background thread, streamed to asyncio.

The loop thread calls `DiffusionEngine.step()` while requests are unfinished and sleeps
otherwise; every event is handed (by the request's listener, whichever thread stepped) to the
asyncio queue of its request. A consumer that stops listening (its task is cancelled or it
breaks out of the iterator) aborts its request, which then frees its slot at the next step
boundary. If the loop thread dies, `is_running` turns False, `error` says why, unfinished
requests fail and new ones are refused (the HTTP server's /health then answers 503).

It implements `diffserve.engine.client.EngineClient`: everything but `generate` and the loop's
own `start` / `shutdown` forwards to the `DiffusionEngine` it drives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from diffserve.config import EngineConfig
from diffserve.core.errors import EngineDeadError, EngineOverloadedError
from diffserve.core.messages import ModelInfo
from diffserve.core.outputs import StreamEvent
from diffserve.core.sampling_params import ModelSpec, SamplingParams
from diffserve.engine.engine import DiffusionEngine
from diffserve.engine.input_processor import InputProcessor, ProcessedRequest

logger = logging.getLogger(__name__)


class AsyncDiffusionEngine:
    """Asynchronous, streaming front of a `DiffusionEngine`.

    Args:
        config: engine configuration (ignored when `engine` is given).
        engine: an existing synchronous engine to drive.

    Use `start()` (or ``async with``) before `generate`, and `shutdown()` at the end.
    """

    def __init__(self, config: EngineConfig | None = None, engine: DiffusionEngine | None = None):
        self.engine = engine or DiffusionEngine(config)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self.steps_run = 0
        #: why the loop thread died (None while healthy)
        self.error: str | None = None

    # ------------------------------------------------------------------ loop thread
    def start(self) -> None:
        """Start the engine loop thread (idempotent; a dead loop is not restarted).

        Raises:
            EngineDeadError: the loop thread died earlier.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine loop died: {self.error}")
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._accepting = True
            self._thread = threading.Thread(target=self._loop, name="diffserve-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        """The loop thread was started, is alive and has not died of an error, and the
        executor's workers are alive."""
        if self.error is None and self.engine.error is not None:
            self.error = self.engine.error
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                try:
                    self.engine.step()  # events go to the requests' listeners
                    self.steps_run += 1
                except Exception:  # noqa: BLE001 - the loop must survive an engine bug
                    logger.exception("engine step raised; failing unfinished requests")
                    self.engine.fail_unfinished("internal engine error (see server log)")
        except BaseException as exc:  # the loop thread dies: say so, fail everyone, refuse new work
            self.error = f"{type(exc).__name__}: {exc}"
            self._accepting = False
            logger.critical("engine loop died: %s", self.error)
            try:
                self.engine.fail_unfinished(f"the engine loop died ({self.error})")
            except BaseException:  # noqa: BLE001
                logger.exception("failing unfinished requests after the loop died")

    # -------------------------------------------------------------------- public API
    async def generate(
        self,
        prompt: str | ProcessedRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        preview_steps: Sequence[int] = (),
        inputs: Any = None,
        progress: bool = True,
    ) -> AsyncIterator[StreamEvent]:
        """Submit one request and stream its events until the final one.

        Args:
            prompt: the prompt, or a request the `input_processor` already processed (then
                `params` and `inputs` stay None).
            progress: also stream a ``progress`` event after every denoising step (False: a
                consumer that waits for the result saves one cross-thread hand-off per step).

        Yields:
            `StreamEvent`s: queued, started, progress(step, total) (with `progress`), partial(preview) at
            `preview_steps`, chunk(frames) per chunk of a stream (``num_chunks``), then
            finished(output) / failed(error) / aborted.

        Raises:
            InvalidRequestError: invalid prompt or params (before anything is queued).
            EngineOverloadedError: the waiting queue is full, or the engine is shutting down.
            EngineDeadError: the engine loop died.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine loop died: {self.error}")
        if not self._accepting:
            raise EngineOverloadedError("engine is shutting down and no longer accepts requests")
        self.start()
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def listener(event: StreamEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the consumer's event loop is closed
                self.engine.abort(event.request_id)

        finished = False
        added = False
        try:
            self.engine.add_request(prompt, params, request_id=request_id, preview_steps=preview_steps,
                                    inputs=inputs, listener=listener, progress=progress)
            added = True
            self._wake.set()
            while True:
                event = await queue.get()
                if event.type.is_final:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if added and not finished:
                self.engine.abort(request_id)
                self._wake.set()

    def add_request(self, prompt: str | ProcessedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, preview_steps: Sequence[int] = (), inputs: Any = None,
                    listener: Any = None, progress: bool = True) -> str:
        """Queue a request whose events go to `listener` (called on the engine's loop thread);
        see `DiffusionEngine.add_request`, which raises the same errors."""
        request_id = self.engine.add_request(prompt, params, request_id=request_id, preview_steps=preview_steps,
                                             inputs=inputs, listener=listener, progress=progress)
        self._wake.set()
        return request_id

    def submit_interaction(self, request_id: str, interaction: Mapping[str, Any]) -> str:
        """Change a running stream's prompt from its next chunk on; returns the event id (see
        `DiffusionEngine.submit_interaction`, which raises the same errors). Thread-safe and
        non-blocking."""
        event_id = self.engine.submit_interaction(request_id, interaction)
        self._wake.set()
        return event_id

    def abort(self, request_id: str) -> bool:
        """Abort a request (see `DiffusionEngine.abort`)."""
        aborted = self.engine.abort(request_id)
        self._wake.set()
        return aborted

    # ------------------------------------------------------------ model, counts and stats
    @property
    def config(self) -> EngineConfig:
        """The engine's configuration."""
        return self.engine.config

    @property
    def model_info(self) -> ModelInfo:
        """The loaded model (spec, pipeline class, step batching, chunk streaming)."""
        return self.engine.model_info

    @property
    def spec(self) -> ModelSpec:
        """The loaded model's `ModelSpec` (defaults and limits)."""
        return self.engine.spec

    @property
    def input_processor(self) -> InputProcessor:
        """The `InputProcessor` requests are built with."""
        return self.engine.input_processor

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return self.engine.num_waiting

    @property
    def num_running(self) -> int:
        """Admitted requests (being prepared, denoising, between chunks or being decoded)."""
        return self.engine.num_running

    @property
    def num_running_rows(self) -> int:
        """Denoiser rows held by running requests."""
        return self.engine.num_running_rows

    def queue_position(self, request_id: str) -> int | None:
        """See `DiffusionEngine.queue_position`."""
        return self.engine.queue_position(request_id)

    def stats(self) -> dict[str, Any]:
        """See `DiffusionEngine.stats`."""
        return self.engine.stats()

    def add_step_listener(self, listener) -> None:
        """See `DiffusionEngine.add_step_listener` (called on the loop thread)."""
        self.engine.add_step_listener(listener)

    # ------------------------------------------------------------------ sleep mode
    @property
    def is_sleeping(self) -> bool:
        """See `DiffusionEngine.is_sleeping`."""
        return self.engine.is_sleeping

    @property
    def sleep_state(self) -> str:
        """See `DiffusionEngine.sleep_state`."""
        return self.engine.sleep_state

    @property
    def sleep_level(self) -> int | None:
        """See `DiffusionEngine.sleep_level`."""
        return self.engine.sleep_level

    def sleep(self, level: int = 1) -> None:
        """`DiffusionEngine.sleep` (blocking: call it from a worker thread in async code)."""
        self._wake.set()
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """`DiffusionEngine.wake_up` (blocking)."""
        self.engine.wake_up()

    # ------------------------------------------------------------------ LoRA adapters
    def check_loras(self, loras: Mapping[str, float] | None) -> None:
        """See `DiffusionEngine.check_loras`."""
        self.engine.check_loras(loras)

    def load_lora(self, name: str, path: Any, origin: str = "api", within_lora_dir: bool = False) -> dict[str, Any]:
        """See `DiffusionEngine.load_lora` (blocks: call it off the event loop)."""
        return self.engine.load_lora(name, path, origin, within_lora_dir)

    def unload_lora(self, name: str) -> None:
        """See `DiffusionEngine.unload_lora`."""
        self.engine.unload_lora(name)

    def list_loras(self) -> list[dict[str, Any]]:
        """See `DiffusionEngine.list_loras`."""
        return self.engine.list_loras()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `timeout_s` seconds, abort
        the rest, then stop the loop thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.is_running and self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        for request_id in self.engine.unfinished_request_ids():
            self.engine.abort(request_id)
        drain_deadline = time.monotonic() + 5.0
        while self.is_running and self.engine.has_unfinished_requests() and time.monotonic() < drain_deadline:
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    async def __aenter__(self) -> "AsyncDiffusionEngine":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)
