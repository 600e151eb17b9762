"""`SleepMode`: the engine's sleep mode (vLLM's semantics; the weights side is
`diffserve.memory.sleep`, in the workers).

`sleep(level)` stops admitting (new requests get `EngineSleepingError`, HTTP 503), lets every
request already added (waiting or running) run to its end, then puts the executor's weights to
sleep: level 1 off the device, level 2 discarded. `wake_up()` restores them and admits again.
Both are safe to call while other threads step the engine; one sleep or wake runs at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffserve.core.errors import EngineSleepingError
from diffserve.core.sleep_levels import check_level

if TYPE_CHECKING:
    from diffserve.executor.base import Executor

logger = logging.getLogger(__name__)


class SleepMode:
    """The sleep state of one engine (a component the engine owns).

    Args:
        executor: whose weights sleep and wake.
        lock: the engine's lock (guards the state against the admission checks).
        step_lock: held while the executor sleeps or wakes, so no step runs meanwhile.
        drain: steps the engine (or waits for the thread that steps it) until no request is
            held.
    """

    def __init__(self, executor: Executor, lock: threading.RLock, step_lock: threading.Lock,
                 drain: Callable[[], None]):
        self._executor = executor
        self._lock = lock
        self._step_lock = step_lock
        self._drain = drain
        self._level: int | None = None
        self._pending = False
        self._sleep_lock = threading.Lock()

    @property
    def is_sleeping(self) -> bool:
        """The engine is asleep (its weights are off the device or discarded)."""
        return self._level is not None

    @property
    def state(self) -> str:
        """``"awake"``, ``"draining"`` (going to sleep: in-flight requests finish, new ones
        are refused) or ``"asleep"``."""
        if self._level is not None:
            return "asleep"
        return "draining" if self._pending else "awake"

    @property
    def level(self) -> int | None:
        """1 or 2 while asleep, None while awake."""
        return self._level

    def check_awake(self) -> None:
        """Raise unless the engine admits requests.

        Raises:
            EngineSleepingError: asleep, or going to sleep.
        """
        if self._level is not None:
            raise EngineSleepingError(f"the engine is asleep (level {self._level}); wake it up first")
        if self._pending:
            raise EngineSleepingError("the engine is going to sleep and admits no new requests")

    def sleep(self, level: int = 1) -> None:
        """Refuse new requests from now on, let every request already added run to its end,
        then put the weights to sleep: level 1 moves them off the device (to CPU memory on a
        GPU, to a spill file on disk on a CPU device), level 2 discards them (reloaded from
        the model folder by `wake_up`). Blocks until asleep; sleeping again while asleep only
        deepens 1 -> 2.

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
        """
        level = check_level(level)
        with self._sleep_lock:
            with self._lock:
                current = self._level
                self._pending = current is None
            try:
                if current is None:
                    self._drain()
                elif level <= current:
                    return
                with self._step_lock:
                    self._executor.sleep(level)
            finally:
                with self._lock:
                    self._pending = False
            with self._lock:
                self._level = level
        logger.info("engine asleep at level %d", level)

    def wake_up(self) -> None:
        """Restore the weights (byte-identical; level 2 reloads them from the model folder)
        and admit requests again. No-op while awake."""
        with self._sleep_lock:
            if self._level is None:
                return
            with self._step_lock:
                self._executor.wake_up()
            with self._lock:
                self._level = None
        logger.info("engine awake")
