"""Sleep mode of `DiffusionEngine` (vLLM's semantics; the weights side is
`diffserve.memory.sleep`).

`sleep(level)` stops admitting (new requests get `EngineSleepingError`, HTTP 503), lets every
request already added (waiting or running) run to its end, then puts the executor's weights to
sleep: level 1 off the device, level 2 discarded. `wake_up()` restores them and admits again.
Both are safe to call while other threads step the engine; one sleep or wake runs at a time.
"""

from __future__ import annotations

import logging
import threading

from diffserve.core.errors import EngineSleepingError

logger = logging.getLogger(__name__)


class SleepMode:
    """Mixin of `DiffusionEngine`: sleep, wake up, and the admission check while asleep.

    Uses the engine's ``_lock`` / ``_mail`` (condition), ``_step_lock``, ``_requests``,
    ``_step_locked()`` and ``executor``; `_init_sleep_mode` must run in its ``__init__``.
    """

    def _init_sleep_mode(self) -> None:
        self._sleep_level: int | None = None
        self._sleep_pending = False
        self._sleep_lock = threading.Lock()

    @property
    def is_sleeping(self) -> bool:
        """The engine is asleep (its weights are off the device or discarded)."""
        return self._sleep_level is not None

    @property
    def sleep_state(self) -> str:
        """``"awake"``, ``"draining"`` (going to sleep: in-flight requests finish, new ones
        are refused) or ``"asleep"``."""
        if self._sleep_level is not None:
            return "asleep"
        return "draining" if self._sleep_pending else "awake"

    @property
    def sleep_level(self) -> int | None:
        """1 or 2 while asleep, None while awake."""
        return self._sleep_level

    def _check_awake(self) -> None:
        if self._sleep_level is not None:
            raise EngineSleepingError(f"the engine is asleep (level {self._sleep_level}); wake it up first")
        if self._sleep_pending:
            raise EngineSleepingError("the engine is going to sleep and admits no new requests")

    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (vLLM's sleep mode; `diffserve.memory.sleep`): new requests
        are refused (`EngineSleepingError`) from now on, every request already added (waiting
        or running) runs to its end, then level 1 moves the weights off the device (to CPU
        memory on a GPU, to a spill file on disk on a CPU device) and level 2 discards them
        (reloaded from the model folder by `wake_up`). Blocks until asleep; sleeping again
        while asleep only deepens 1 -> 2. Safe to call while other threads step the engine.

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
        """
        from diffserve.core.sleep_levels import check_level

        level = check_level(level)
        with self._sleep_lock:
            with self._lock:
                current = self._sleep_level
                self._sleep_pending = current is None
            try:
                if current is None:
                    self._drain()
                elif level <= current:
                    return
                with self._step_lock:
                    self.executor.sleep(level)
            finally:
                with self._lock:
                    self._sleep_pending = False
            with self._lock:
                self._sleep_level = level
        logger.info("engine asleep at level %d", level)

    def wake_up(self) -> None:
        """Restore the weights (byte-identical; level 2 reloads them from the model folder)
        and admit requests again. No-op while awake."""
        with self._sleep_lock:
            if self._sleep_level is None:
                return
            with self._step_lock:
                self.executor.wake_up()
            with self._lock:
                self._sleep_level = None
        logger.info("engine awake")

    def _drain(self) -> None:
        """Step (or wait for the thread that steps) until no request is held."""
        while True:
            with self._lock:
                if not self._requests:
                    return
            self._step_or_wait(lambda: bool(self._requests))
