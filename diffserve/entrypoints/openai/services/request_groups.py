"""A group of engine requests serving one HTTP request (the ``n`` images of an image request,
the one video of a video job): submitted together, their events merged into one stream, their
outcomes counted in the metrics, aborted together.

If the engine loop dies, waiting on the group ends within `ENGINE_CHECK_INTERVAL_S` seconds with
failed events (`ENGINE_DEAD_MESSAGE`) instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from diffserve.core.errors import EngineDeadError
from diffserve.core.outputs import EventType, StreamEvent
from diffserve.engine.client import EngineClient, ProcessedRequest
from diffserve.entrypoints.openai.ops.metrics import ServerMetrics

logger = logging.getLogger(__name__)

#: Seconds between checks that the engine loop is alive while a request waits on it.
ENGINE_CHECK_INTERVAL_S = 0.5
#: Message of requests failed because the engine loop died.
ENGINE_DEAD_MESSAGE = "the engine loop stopped unexpectedly; the server cannot generate images (see the server log)"


class RequestGroup:
    """The engine requests of one HTTP request (ids ``{request_id}-{i}``, one per image or
    video), their events merged into one queue. Records each request's outcome in the metrics:
    from its final event, or as aborted when the group is closed before its final event was
    read. A group rejected at submission (429) records nothing: its requests never ran (the
    HTTP request is counted as a 429).

    Args:
        engine: the running engine (its async client).
        request_id: the HTTP request's id.
        requests: the engine requests, as the engine's input processor made them.
        metrics: the server's metrics.
        preview_steps: denoising steps after which previews are decoded (``partial`` events).
        progress: whether the requests emit ``progress`` events (one per denoising step).
    """

    def __init__(self, engine: EngineClient, request_id: str, requests: Sequence[ProcessedRequest],
                 metrics: ServerMetrics, preview_steps: Sequence[int] = (), progress: bool = True):
        self._engine = engine
        self._requests = list(requests)
        self._preview_steps = list(preview_steps)
        self._progress = progress
        self._metrics = metrics
        self._unreported = set(range(len(self._requests)))
        self.ids = [f"{request_id}-{i}" for i in range(len(self._requests))]
        self._queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def submit(self, on_queued: Callable[[], None] | None = None,
                     engine_alive: Callable[[], bool] = lambda: True) -> None:
        """Queue every request in the engine, one right after the other on the event loop.

        Args:
            on_queued: called (on the event loop) once every request was handed to the engine,
                before their first events arrive.
            engine_alive: checked every `ENGINE_CHECK_INTERVAL_S` seconds while waiting for the
                first events.

        Raises:
            InvalidRequestError / EngineOverloadedError: from the engine; then none of the
                requests stays queued (those already queued are aborted; the engine drops them
                at its next step) and none is counted in the metrics.
            EngineDeadError: the engine loop stopped before the first events came.
        """
        gens = [self._engine.generate(request, request_id=rid, preview_steps=self._preview_steps,
                                      progress=self._progress)
                for rid, request in zip(self.ids, self._requests)]

        async def first_event(gen):
            return await anext(gen)

        # gather schedules each task's first step now, in order; a first step runs `generate`
        # up to its first wait, i.e. queues the request. A callback scheduled after them runs
        # once all n are queued.
        gathered = asyncio.gather(*(first_event(g) for g in gens), return_exceptions=True)
        if on_queued is not None:
            asyncio.get_running_loop().call_soon(on_queued)
        while not (await asyncio.wait({gathered}, timeout=ENGINE_CHECK_INTERVAL_S))[0]:
            if not engine_alive():
                gathered.cancel()  # the generators' cleanup aborts their requests
                await asyncio.gather(gathered, return_exceptions=True)
                self._unreported.clear()
                raise EngineDeadError(ENGINE_DEAD_MESSAGE)
        results = gathered.result()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for gen, result in zip(gens, results):
                if not isinstance(result, BaseException):
                    await gen.aclose()  # aborts it
            self._unreported.clear()
            raise errors[0]
        for index, (gen, first) in enumerate(zip(gens, results)):
            self._queue.put_nowait((index, first))
            if not first.type.is_final:
                self._tasks.append(asyncio.create_task(self._pump(index, gen)))

    async def _pump(self, index: int, gen: AsyncIterator[StreamEvent]) -> None:
        try:
            async for event in gen:
                self._queue.put_nowait((index, event))
        except Exception as exc:  # noqa: BLE001 - surface as this image's failure
            logger.exception("engine stream of %s raised", self.ids[index])
            self._queue.put_nowait((index, StreamEvent(self.ids[index], EventType.FAILED,
                                                       error=f"{type(exc).__name__}: {exc}")))

    async def events(self, engine_alive: Callable[[], bool] = lambda: True,
                     tick_s: float | None = None) -> AsyncIterator[tuple[int, StreamEvent] | None]:
        """(image index, event) as they happen, until every request's final event.

        Args:
            engine_alive: checked every `ENGINE_CHECK_INTERVAL_S` seconds while waiting; once
                it returns False, every unfinished request gets a failed event
                (`ENGINE_DEAD_MESSAGE`).
            tick_s: when given, also yields None every `tick_s` seconds (a clock tick for
                keep-alive comments), whether or not events came.
        """
        remaining = len(self.ids)
        finished: set[int] = set()
        loop = asyncio.get_running_loop()
        next_tick = loop.time() + tick_s if tick_s is not None else float("inf")
        while remaining:
            timeout = min(ENGINE_CHECK_INTERVAL_S, max(0.0, next_tick - loop.time()))
            try:
                item: tuple[int, StreamEvent] | None = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                item = None
                if not engine_alive() and self._queue.empty():
                    for index in range(len(self.ids)):
                        if index not in finished:
                            self._queue.put_nowait((index, StreamEvent(self.ids[index], EventType.FAILED,
                                                                       error=ENGINE_DEAD_MESSAGE)))
                            finished.add(index)
            if tick_s is not None and loop.time() >= next_tick:
                next_tick = loop.time() + tick_s
                yield None
            if item is None:
                continue
            index, event = item
            if event.type.is_final:
                finished.add(index)
                remaining -= 1
                self._unreported.discard(index)
                if event.output is not None:
                    self._metrics.observe_output(event.output)
                else:
                    self._metrics.observe_abandoned(1, outcome="failed")
            yield index, event

    async def wait_all(self, engine_alive: Callable[[], bool] = lambda: True) -> list[StreamEvent]:
        """The final event of every request, by image index (see `events`)."""
        finals: list[StreamEvent | None] = [None] * len(self.ids)
        async for item in self.events(engine_alive):
            index, event = item  # type: ignore[misc]
            if event.type.is_final:
                finals[index] = event
        return finals  # type: ignore[return-value]

    def abort(self) -> None:
        """Abort every request of the group (effective at the engine's next step)."""
        for request_id in self.ids:
            self._engine.abort(request_id)

    async def close(self) -> None:
        """Stop listening; an unfinished request is aborted by its stream's cleanup."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._metrics.observe_abandoned(len(self._unreported))
        self._unreported.clear()
