"""diffserve's opt-in Server-Sent Events extension (request field ``stream_progress=true`` with
``stream=true``): where each image is, between OpenAI's own ``*.partial_image`` and
``*.completed`` events.

Events (the ``data:`` of each is one JSON object whose ``type`` repeats the event name;
``image_index`` says which of the request's ``n`` images it is about):
    diffserve.queued    ``{"type", "image_index", "queue_position"}``: the image waits in the
                        engine's waiting queue at this 1-based place (1 = admitted next;
                        admission is first-come-first-served and the requests of every client
                        count). Sent when the image is queued and again whenever its place
                        changes (checked on every clock tick of the stream, at least every 0.25 s).
    diffserve.progress  ``{"type", "image_index", "step", "num_inference_steps"}``: denoising
                        steps done; ``step`` 0 when the image leaves the queue (its prompt is
                        encoded next), then once per denoising step.
    diffserve.ar_delta  ``{"type", "image_index", "delta"}``: multi-stage models whose AR stage
                        writes text (the built-in ``digits-reasoning``): each new piece of it as
                        it is generated, before the image's progress events (the pieces add up to
                        the image's ``revised_prompt``).

Without ``stream_progress`` the stream holds exactly OpenAI's events, so OpenAI clients see
nothing new.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from diffserve.core.outputs import EventType, StreamEvent

if TYPE_CHECKING:
    from diffserve.engine.client import EngineClient



class StreamProgress:
    """Turns the engine events of one HTTP request's images into ``diffserve.*`` SSE payloads.

    Args:
        engine: the engine the requests are queued in (read for queue places).
        request_ids: the engine request id of each image, by image index.
    """

    def __init__(self, engine: EngineClient, request_ids: Sequence[str]):
        self._engine = engine
        self._ids = list(request_ids)
        #: image index -> the place last sent, for the images still waiting
        self._waiting: dict[int, int | None] = {}

    @property
    def waiting(self) -> bool:
        """Whether any image of the request is still in the waiting queue."""
        return bool(self._waiting)

    def on_event(self, index: int, event: StreamEvent) -> list[dict[str, Any]]:
        """The payloads to send for engine event `event` of image `index` (may be empty)."""
        if event.type is EventType.QUEUED:
            self._waiting[index] = None
            return self._queued(index)
        if event.type is EventType.AR_DELTA:  # (in the AR stage: it joins the waiting queue after)
            return [{"type": "diffserve.ar_delta", "image_index": index, "delta": event.text}]
        self._waiting.pop(index, None)
        if event.type in (EventType.STARTED, EventType.PROGRESS):
            return [{"type": "diffserve.progress", "image_index": index, "step": event.step,
                     "num_inference_steps": event.total}]
        return []

    def on_tick(self) -> list[dict[str, Any]]:
        """Payloads for the waiting images whose queue place changed since last sent."""
        return [payload for index in list(self._waiting) for payload in self._queued(index)]

    def _queued(self, index: int) -> list[dict[str, Any]]:
        position = self._engine.queue_position(self._ids[index])
        if position is None or position == self._waiting.get(index):
            return []  # admitted meanwhile (its started event follows), or unchanged
        self._waiting[index] = position
        return [{"type": "diffserve.queued", "image_index": index, "queue_position": position}]
