"""Clients of a multi-stage model's AR stage: the engine's side of `diffserve.runner.ar_stage`.

- `InProcessARStage`: the AR stage runs in the engine's process on its own threads; payloads
  go through an `InProcessConnector` shared with the DiT runner (nothing is copied).
- `MultiprocARStage`: the AR stage runs in its own process (``--executor multiprocess``);
  payloads go through shared memory (`SharedMemoryConnector`: the AR process writes each
  distinct payload once, the DiT worker maps it). Only plain data crosses the pipe: the
  request's prompt and params one way, the `ARDone` (its `PayloadHandle`, text, timings) or the
  error the other way.

Both return a ``concurrent.futures.Future`` per submitted request and forward `abort` / `free`
(idempotent). A dead AR process fails every pending and later request with `EngineDeadError`.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
from concurrent.futures import Future
from typing import Any

from diffserve.core.errors import EngineDeadError

logger = logging.getLogger(__name__)

#: Seconds to wait for the AR process to load its model.
STARTUP_TIMEOUT_S = 600.0


def _config_device(config) -> tuple[Any, Any]:
    return config.torch_device, config.torch_dtype


class InProcessARStage:
    """The AR stage on threads of this process (see the module docstring).

    Args:
        config: engine configuration (model folder, device, dtype, load format, threads,
            ``max_batch_size`` as the AR batch limit).
        connector: the connector shared with the in-process DiT runner.
    """

    def __init__(self, config, connector):
        from diffserve.runner.ar_stage import ARStageRunner
        from diffserve.runner.loader import load_ar_stage

        device, dtype = _config_device(config)
        stage = load_ar_stage(config.model_path, device, dtype, config.load_format, config.variant)
        self.connector = connector
        self.runner = ARStageRunner(stage, connector, max_batch=max(config.max_batch_size, 1))

    def submit(self, request_id: str, prompt: str, params, on_delta=None) -> Future:
        """See `ARStageRunner.submit`."""
        return self.runner.submit(request_id, prompt, params, on_delta)

    def check(self, prompt: str, params) -> None:
        """Raise `InvalidRequestError` if the request cannot run in the AR stage (prompt too
        long for the LM, ...), before it is queued."""
        self.runner.model.inputs("check", prompt, params)

    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    def free(self, request_ids: list[str]) -> None:
        self.runner.free(request_ids)

    def stats(self) -> dict[str, Any]:
        return self.runner.stats()

    @property
    def dead(self) -> str | None:
        return None

    def shutdown(self) -> None:
        self.runner.shutdown()


def _ar_main(config, conn) -> None:  # pragma: no cover - child process
    """The AR process: load the AR stage, run requests, answer over `conn`."""
    import torch

    from diffserve.connector.shared_memory import SharedMemoryConnector
    from diffserve.runner.ar_stage import ARStageRunner
    from diffserve.runner.loader import load_ar_stage

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    connector = SharedMemoryConnector()
    try:
        device, dtype = _config_device(config)
        stage = load_ar_stage(config.model_path, device, dtype, config.load_format, config.variant)
        runner = ARStageRunner(stage, connector, max_batch=max(config.max_batch_size, 1))
        send(("ready", None, True, None))
    except BaseException as exc:  # noqa: BLE001 - reported as the load error
        send(("ready", None, False, _portable(exc)))
        return

    def forward(request_id: str, future: Future) -> None:
        try:
            send(("done", request_id, True, future.result()))
        except BaseException as exc:  # noqa: BLE001
            send(("done", request_id, False, _portable(exc)))

    while True:
        try:
            method, message_id, args = conn.recv()
        except (EOFError, OSError):
            break
        if method == "shutdown":
            break
        try:
            if method == "submit":
                request_id, prompt, params, streaming = args
                on_delta = (lambda text, rid=request_id: send(("delta", rid, True, text))) if streaming else None
                runner.submit(request_id, prompt, params, on_delta).add_done_callback(
                    lambda f, rid=request_id: forward(rid, f))
            elif method == "abort":
                runner.abort(*args)
            elif method == "free":
                runner.free(*args)
            elif method == "stats":
                send(("reply", message_id, True, runner.stats()))
            elif method == "check":
                runner.model.inputs("check", *args)
                send(("reply", message_id, True, None))
        except BaseException as exc:  # noqa: BLE001 - a bad request fails alone
            if method == "submit":
                send(("done", args[0], False, _portable(exc)))
            elif method in ("stats", "check"):
                send(("reply", message_id, False, _portable(exc)))
    runner.shutdown()
    connector.close()


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError with its text (errors cross the pipe)."""
    import pickle

    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class MultiprocARStage:
    """The AR stage in its own process (see the module docstring).

    Raises:
        UnsupportedModelError / other load errors: the AR process could not load the stage.
        EngineDeadError: it died while loading.
    """

    def __init__(self, config):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_ar_main, args=(config, child), daemon=True, name="diffserve-ar-stage")
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._listeners: dict[str, Any] = {}
        self._stats: dict[int, Future] = {}
        self._ids = itertools.count()
        self._dead: str | None = None
        self._ready: Future = Future()
        self._reader = threading.Thread(target=self._read, daemon=True, name="diffserve-ar-stage-reader")
        self._reader.start()
        try:
            self._ready.result(timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _read(self) -> None:
        while True:
            try:
                kind, key, ok, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "ready":
                (self._ready.set_result if ok else self._ready.set_exception)(payload)
                continue
            if kind == "delta":
                listener = self._listeners.get(key)
                if listener is not None:
                    try:
                        listener(payload)
                    except Exception:  # noqa: BLE001
                        logger.exception("AR text listener for %s raised", key)
                continue
            with self._lock:
                if kind == "done":
                    self._listeners.pop(key, None)
                future = self._futures.pop(key, None) if kind == "done" else self._stats.pop(key, None)
            if future is not None and not future.done():
                (future.set_result if ok else future.set_exception)(payload)
        self._proc.join(timeout=1)
        self._dead = f"the AR stage process died (exit code {self._proc.exitcode})"
        error = EngineDeadError(self._dead)
        if not self._ready.done():
            self._ready.set_exception(error)
        with self._lock:
            pending = list(self._futures.values()) + list(self._stats.values())
            self._futures.clear()
            self._stats.clear()
        for future in pending:
            if not future.done():
                future.set_exception(error)

    def _send(self, method: str, message_id: Any, *args) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        with self._send_lock:
            self._conn.send((method, message_id, args))

    def submit(self, request_id: str, prompt: str, params, on_delta=None) -> Future:
        """See `ARStageRunner.submit` (`on_delta` runs on this client's reader thread)."""
        future: Future = Future()
        with self._lock:
            self._futures[request_id] = future
            if on_delta is not None:
                self._listeners[request_id] = on_delta
        try:
            self._send("submit", None, request_id, prompt, params, on_delta is not None)
        except BaseException as exc:  # noqa: BLE001
            with self._lock:
                self._futures.pop(request_id, None)
                self._listeners.pop(request_id, None)
            future.set_exception(exc)
        return future

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._listeners.pop(request_id, None)
        if self._dead is None:
            self._send("abort", None, request_id)

    def free(self, request_ids: list[str]) -> None:
        if self._dead is None and request_ids:
            self._send("free", None, list(request_ids))

    def _call(self, method: str, *args) -> Any:
        """A request-reply round trip to the AR process."""
        future: Future = Future()
        message_id = next(self._ids)
        with self._lock:
            self._stats[message_id] = future
        self._send(method, message_id, *args)
        return future.result(timeout=60)

    def check(self, prompt: str, params) -> None:
        """See `InProcessARStage.check` (a round trip to the AR process)."""
        self._call("check", prompt, params)

    def stats(self) -> dict[str, Any]:
        if self._dead is not None:
            return {"dead": self._dead}
        return self._call("stats")

    @property
    def dead(self) -> str | None:
        return self._dead

    def shutdown(self) -> None:
        try:
            if self._dead is None:
                self._send("shutdown", None)
        except Exception:  # noqa: BLE001
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


def build_ar_stage(config, executor) -> "InProcessARStage | MultiprocARStage":
    """The AR stage client for a multi-stage model served by `executor`: on threads of this
    process, sharing the in-process runner's connector (nothing copied), or, when the DiT stage
    runs in worker processes, in its own process putting into shared memory.

    Raises:
        UnsupportedModelError / other load errors: the AR stage could not load.
    """
    runner = getattr(executor, "runner", None)
    if runner is not None and getattr(runner, "connector", None) is not None:
        return InProcessARStage(config, runner.connector)
    return MultiprocARStage(config)


__all__ = ["InProcessARStage", "MultiprocARStage", "build_ar_stage"]
