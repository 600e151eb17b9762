"""`SchedulerCounters`: what the request scheduler counts for ``stats()`` and ``/metrics``:
rows and image tokens per denoiser forward, queueing delay by priority, SLO attainment and
goodput, refusals of ``--admission slo``. Each update is a few integer / float operations
(once per step, once per admission, once per ending)."""

from __future__ import annotations

import time

#: Most distinct priorities counted one by one; later ones share the bucket ``"other"``
#: (``priority`` is any 32-bit integer a client sends: each would be a ``/metrics`` series).
MAX_PRIORITY_BUCKETS = 32
OTHER_PRIORITIES = "other"


class SchedulerCounters:
    """Counters since the engine started (see the module docstring).

    Attributes:
        forwards / rows / tokens: denoiser forwards run, and the rows and image tokens in them.
        slots: image token slots of those forwards (rows x each forward's widest row's tokens;
            slots - tokens were padding).
        queue: priority -> [admitted requests, seconds queued in total, longest seconds]; at
            most `MAX_PRIORITY_BUCKETS` priorities, then ``"other"`` for any further one.
        slo_met / slo_missed: finished requests with a ``deadline_s`` that met / missed it;
            ``slo_met_images``: the images of the met ones (goodput's numerator).
        refused: requests ``--admission slo`` refused at arrival.
        join_waits: ticks that held their step for the prepares of requests admitted in them
            (the request scheduler's join wait).
        start: ``time.perf_counter()`` when counting began (goodput's denominator).
    """

    def __init__(self) -> None:
        self.forwards = self.rows = self.tokens = self.slots = 0
        self.queue: dict[int | str, list] = {}
        self.slo_met = self.slo_missed = self.slo_met_images = self.refused = 0
        self.join_waits = 0
        self.start = time.perf_counter()

    def forward(self, rows: int, tokens: int, slots: int = 0) -> None:
        """One denoiser forward of `rows` rows, `tokens` image tokens and `slots` image token
        slots (rows x its widest row's tokens; 0 = not known)."""
        self.forwards += 1
        self.rows += rows
        self.tokens += tokens
        self.slots += max(slots, tokens)

    def queued(self, priority: int, seconds: float) -> None:
        """A request of `priority` admitted after `seconds` in the waiting queue."""
        key: int | str = priority
        if key not in self.queue and sum(1 for k in self.queue if k != OTHER_PRIORITIES) >= MAX_PRIORITY_BUCKETS:
            key = OTHER_PRIORITIES
        entry = self.queue.get(key)
        if entry is None:
            entry = self.queue[key] = [0, 0.0, 0.0]
        entry[0] += 1
        entry[1] += seconds
        entry[2] = max(entry[2], seconds)

    def finished_with_deadline(self, met: bool, images: int) -> None:
        """A finished request with a deadline, which it `met` or missed."""
        if met:
            self.slo_met += 1
            self.slo_met_images += images
        else:
            self.slo_missed += 1

    def as_dict(self) -> dict:
        """``forwards``, ``mean_rows_per_forward``, ``mean_tokens_per_forward``,
        ``padded_token_share`` (padded image token slots / all of them, over every forward),
        ``queue_delay_s`` ({priority: {"requests", "mean", "max"}}, by priority as text, at
        most `MAX_PRIORITY_BUCKETS` of them plus ``"other"``), ``slo_attainment`` (met /
        finished with a deadline; None without any), ``slo_met``, ``slo_missed``,
        ``goodput_images_per_s`` (images of deadline-meeting requests per second since start),
        ``refused_deadline``, ``join_waits``."""
        judged = self.slo_met + self.slo_missed
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "forwards": self.forwards,
            "mean_rows_per_forward": self.rows / self.forwards if self.forwards else 0.0,
            "mean_tokens_per_forward": self.tokens / self.forwards if self.forwards else 0.0,
            "padded_token_share": 1.0 - self.tokens / self.slots if self.slots else 0.0,
            "queue_delay_s": {str(p): {"requests": n, "mean": total / n, "max": longest}
                              for p, (n, total, longest) in sorted(self.queue.copy().items(),
                                                                   key=lambda kv: (isinstance(kv[0], str), kv[0]))},
            "slo_attainment": self.slo_met / judged if judged else None,
            "slo_met": self.slo_met,
            "slo_missed": self.slo_missed,
            "goodput_images_per_s": self.slo_met_images / elapsed,
            "refused_deadline": self.refused,
            "join_waits": self.join_waits,
        }


__all__ = ["SchedulerCounters"]
