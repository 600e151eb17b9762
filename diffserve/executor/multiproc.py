"""`MultiprocExecutor`: the model runs in worker processes, one per rank of the CFG x Ulysses
grid (`diffserve.parallel`); the engine talks to them only through the plain-data messages of
`diffserve.core.messages`, over pipes: each engine tick's `SchedulerOutput` is ONE message to
every rank.

Every worker holds a full runner inside a `diffserve.runner.worker.Worker` and executes every
scheduler output in the same order: all ranks prepare every request (prompt encoding has no
collectives), all run every denoising step (the collectives of CFG / Ulysses parallelism happen
inside it, in the same order on every rank), and only rank 0 decodes (the others free the
request). A stream's chunk boundary (`ChunkWork`, with the interactions it applies) runs on
every rank: each holds the stream's state and must condition the next chunk identically; rank
0's result is returned. A worker runs steps on its main thread and prepare / decode on a side
thread, like the in-process executor, so encode and decode overlap the steps there too. The
step and each background work item reply under ids of their own.

A worker that dies (killed, out of memory, a crash in native code) is noticed when its pipe
closes: every pending and later work item fails with `EngineDeadError` naming the rank and its
exit code, `stats()["workers_alive"]` drops (the server's /health answers 503), and nothing
waits forever.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import pickle
import socket
import threading
import traceback
from concurrent.futures import Future
from typing import Any

from diffserve.core.errors import EngineDeadError
from diffserve.core.messages import ModelInfo, RequestPlan, SchedulerOutput, StepOutput
from diffserve.core.sampling_params import SamplingParams
from diffserve.executor.base import Executor
from diffserve.runner.worker import WorkItem, Worker, work_items

logger = logging.getLogger(__name__)

#: Seconds to wait for the workers to load the model before giving up.
STARTUP_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- worker
def _worker_main(config, rank: int, master_port: int, conn) -> None:  # pragma: no cover - child process
    """A worker process: join the grid, load the model, serve work items until told to stop."""
    from diffserve.core.library_warnings import silence_inapplicable_library_warnings

    silence_inapplicable_library_warnings()  # before torch, diffusers and torchao are imported
    import torch

    from diffserve.parallel.state import init_parallel, shutdown_parallel
    from diffserve.runner import build_runner

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    send_lock = threading.Lock()
    runner = None

    def reply(message_id, ok: bool, payload) -> None:
        runner_peak = 0
        try:
            runner_peak = runner.peak_memory_bytes()
        except Exception:  # noqa: BLE001 - runner not built yet
            pass
        with send_lock:
            conn.send((message_id, ok, payload, runner_peak))

    try:
        state = init_parallel(rank, config.cfg_parallel_size, config.ulysses_degree, master_port,
                              config.torch_device)
        runner = build_runner(config, parallel=state)
        reply("ready", True, runner.info())
    except BaseException as exc:  # noqa: BLE001 - reported to the engine as the load error
        runner = None
        reply("ready", False, _portable(exc))
        return
    worker = Worker(runner, overlap=True, is_driver=state.is_driver)

    def run(message_id, fn, *args) -> None:
        try:
            reply(message_id, True, fn(*args))
        except BaseException as exc:  # noqa: BLE001
            reply(message_id, False, _portable(exc))

    def replier(message_id):
        def done(future) -> None:
            exc = future.exception()
            reply(message_id, exc is None, future.result() if exc is None else _portable(exc))
        return done

    while True:
        try:
            message_id, method, args = conn.recv()
        except (EOFError, OSError):
            break
        if method == "shutdown":
            break
        if method == "execute":  # every rank runs every scheduler output, in the same order
            out, step_id, work_ids = args
            try:
                submitted = worker.submit(out)
            except BaseException as exc:  # noqa: BLE001 - fails the tick's work items
                for work_id in work_ids:
                    reply(work_id, False, _portable(exc))
                submitted = []
            for (_, future), work_id in zip(submitted, work_ids):
                future.add_done_callback(replier(work_id))
            if step_id is not None:  # main thread: collectives in the same order on every rank
                run(step_id, worker.step, out.step_ids)
        elif method == "load_lora":  # the worker's loader thread: a slow read stalls neither steps nor decodes
            worker.load_lora(*args).add_done_callback(replier(message_id))
        elif method == "unload_lora":
            run(message_id, worker.unload_lora, *args)
        elif method == "plan":
            run(message_id, runner.plan, *args)
        elif method == "stats":
            run(message_id, lambda: {"acceleration": runner.acceleration_stats(),
                                     "nonfinite_outputs": runner.nonfinite_count,
                                     **({"payloads": runner.payload_stats()}
                                        if runner.payload_stats() is not None else {})})
        else:
            reply(message_id, False, ValueError(f"unknown work item {method!r}"))
    worker.shutdown()
    shutdown_parallel(state)


# ---------------------------------------------------------------------------------- driver
class _Pending:
    """A work item sent to several ranks; resolves when all replied (rank 0's result)."""

    def __init__(self, ranks: int):
        self.future: Future = Future()
        self.remaining = ranks
        self.result: Any = None
        self.error: BaseException | None = None


class MultiprocExecutor(Executor):
    """Runs one `ModelRunner` per rank in worker processes (see the module docstring).

    Args:
        config: engine configuration (``cfg_parallel_size`` x ``ulysses_degree`` workers).

    Raises:
        UnsupportedModelError / InvalidRequestError: a worker could not load the model (the
            worker's error, re-raised here).
        EngineDeadError: a worker died while loading.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.world_size = config.cfg_parallel_size * config.ulysses_degree
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._conns, self._procs = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, port, child), daemon=True,
                               name=f"diffserve-worker-{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._send_locks = [threading.Lock() for _ in self._conns]
        self._pending: dict[Any, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: str | None = None
        self._peak = 0
        self._info: ModelInfo | None = None
        self._closing = False
        #: the reply of the step sent with the current tick's output (`_submit` -> `_step`)
        self._step_future: Future | None = None
        self._startup = [Future() for _ in self._conns]
        self._readers = [threading.Thread(target=self._read, args=(rank,), daemon=True,
                                          name=f"diffserve-worker-{rank}-reader")
                         for rank in range(self.world_size)]
        for reader in self._readers:
            reader.start()
        try:
            infos = [f.result(timeout=STARTUP_TIMEOUT_S) for f in self._startup]
        except BaseException:
            self.shutdown()
            raise
        self._info = infos[0]

    # ------------------------------------------------------------------ plumbing
    def _read(self, rank: int) -> None:
        conn = self._conns[rank]
        while True:
            try:
                message_id, ok, payload, peak = conn.recv()
            except (EOFError, OSError):
                break
            if rank == 0:
                self._peak = peak
            if message_id == "ready":
                future = self._startup[rank]
                if ok:
                    future.set_result(payload)
                else:
                    future.set_exception(payload)
                continue
            with self._pending_lock:
                pending = self._pending.get(message_id)
            if pending is None:
                continue
            if not ok and pending.error is None:
                pending.error = payload
            if rank == 0 and ok:
                pending.result = payload
            with self._pending_lock:  # one reader thread per rank
                pending.remaining -= 1
                last = pending.remaining == 0
                if last:
                    self._pending.pop(message_id, None)
            if last:
                if pending.error is not None:
                    pending.future.set_exception(pending.error)
                else:
                    pending.future.set_result(pending.result)
        self._on_worker_exit(rank)

    def _on_worker_exit(self, rank: int) -> None:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        if self._dead is None:
            self._dead = f"worker {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
            if not self._closing:
                logger.error("diffserve %s", self._dead)
        error = EngineDeadError(f"the engine's {self._dead}")
        for future in self._startup:
            if not future.done():
                future.set_exception(error)
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def _send(self, message_id: Any, method: str, args: tuple, reply_ids: list[Any]) -> list[Future]:
        """Send one message to every rank; returns a future per reply id (each resolves once
        every rank replied under it, with rank 0's result)."""
        pendings = [_Pending(self.world_size) for _ in reply_ids]
        if self._dead is not None:
            for p in pendings:
                p.future.set_exception(EngineDeadError(f"the engine's {self._dead}"))
            return [p.future for p in pendings]
        with self._pending_lock:
            self._pending.update(zip(reply_ids, pendings))
        try:
            for conn, lock in zip(self._conns, self._send_locks):
                with lock:
                    conn.send((message_id, method, args))
        except (OSError, EOFError, BrokenPipeError) as exc:
            with self._pending_lock:
                for reply_id in reply_ids:
                    self._pending.pop(reply_id, None)
            for p in pendings:
                if not p.future.done():
                    p.future.set_exception(EngineDeadError(f"cannot reach a worker: {exc}"))
        return [p.future for p in pendings]

    def _call(self, method: str, *args) -> Future:
        message_id = next(self._ids)
        return self._send(message_id, method, args, [message_id])[0]

    # ------------------------------------------------------------------ Executor
    def info(self) -> ModelInfo:
        return self._info

    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        return self._call("plan", params, inputs).result()

    def _submit(self, out: SchedulerOutput) -> list[tuple[WorkItem, Future]]:
        """Send `out` to every rank as ONE message; the step's reply and each background work
        item's come back under reply ids of their own (the workers list the items with
        `work_items`, in the same order)."""
        items = work_items(out) if out.has_work else []
        if not (items or out.step_ids or out.finished_ids):
            return []
        step_id = next(self._ids) if out.step_ids else None
        work_ids = [next(self._ids) for _ in items]
        futures = self._send(None, "execute", (out, step_id, work_ids),
                             ([step_id] if step_id is not None else []) + work_ids)
        if step_id is not None:
            self._step_future, futures = futures[0], futures[1:]
        return list(zip(items, futures))

    def submit_load_lora(self, name: str, path: str) -> "Future[dict[str, Any]]":
        return self._call("load_lora", name, path)

    def unload_lora(self, name: str) -> None:
        self._call("unload_lora", name).result()

    def _step(self, request_ids: list[str]) -> StepOutput:
        future, self._step_future = self._step_future, None
        return future.result()

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def workers_alive(self) -> int:
        """Worker processes still running."""
        return sum(p.is_alive() for p in self._procs)

    def stats(self) -> dict[str, Any]:
        """Rank 0's acceleration counters and non-finite count, ``workers_alive`` /
        ``world_size``, and ``dead`` (why the executor stopped, or None)."""
        base = {"workers_alive": self.workers_alive, "world_size": self.world_size, "dead": self._dead}
        if self._dead is not None:
            return {**base, "acceleration": {}, "nonfinite_outputs": 0}
        try:
            return {**self._call("stats").result(timeout=10.0), **base}
        except Exception:  # noqa: BLE001 - a worker just died
            return {**base, "acceleration": {}, "nonfinite_outputs": 0}

    def peak_memory_bytes(self) -> int:
        return self._peak

    def shutdown(self) -> None:
        self._closing = True
        for conn, lock in zip(self._conns, self._send_locks):
            try:
                with lock:
                    conn.send((None, "shutdown", ()))
            except (OSError, EOFError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles (diffserve's errors keep their type and fields), else a RuntimeError
    with its class name, message and the worker's traceback logged."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        logger.error("worker error: %s", "".join(traceback.format_exception(exc)))
        return RuntimeError(f"{type(exc).__name__}: {exc}")

