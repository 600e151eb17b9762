"""`StepRun`: the consecutive denoising steps of one unchanged batch, booked once for all of
its requests.

Between two changes of the batch (a request joins, finishes, previews, fails or is aborted) the
same requests step together, each one step further per step. What the engine records per step
is then the same for every one of them: one more step, the forward's rows, the step's peak
memory and offload loads, the step's end time. A `StepRun` keeps those once for the batch and
adds them to each request's `RequestMetrics` and ``steps_done`` when the run ends (`fold`), so a
step of an unchanged batch costs the engine the same whatever its number of requests; only the
requests that asked for ``progress`` events get one each. The run also knows, from each
request's remaining steps and next preview step, after how many steps some request needs its
own bookkeeping (`until`): the engine ends the run there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffserve.engine.request import Request


@dataclass
class StepRun:
    """The steps of one unchanged batch (see the module docstring).

    Attributes:
        batch: the requests, in batch order (the request scheduler's list; not modified).
        ids: their request ids, in the same order (what the executor is sent every step).
        start_done: each request's ``steps_done`` when the run began.
        until: run steps after which some request finishes its denoising (or its chunk) or
            reaches a preview step; the engine checks each request then, and ends the run.
        progress: (request, ``steps_done`` at the start) of the requests that emit
            ``progress`` events.
        steps: steps taken in the run.
        sizes: forward rows -> steps of the run with that many rows.
        loads: components moved onto the device for the run's steps (model CPU offload).
        peak: the largest step peak memory (bytes above the resident model), None if
            unmeasured.
        end: `time.perf_counter()` seconds at the end of the run's last step.
    """

    batch: list[Request]
    ids: list[str]
    start_done: list[int]
    until: int
    progress: list[tuple[Request, int]]
    steps: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    loads: int = 0
    peak: int | None = None
    end: float = 0.0

    @classmethod
    def start(cls, batch: list[Request], now: float) -> "StepRun":
        """A run of `batch` whose first step starts at `now` (perf_counter seconds); stamps the
        requests' first step time."""
        start_done, until = [], None
        for request in batch:
            if request.first_step_time is None:
                request.first_step_time = now
            done = request.steps_done
            start_done.append(done)
            left = request.num_steps - done
            if request.preview_steps and not request.abort_requested:
                later = [s - done for s in request.preview_steps if s > done]
                if later:
                    left = min(left, min(later))
            until = left if until is None else min(until, left)
        return cls(batch=batch, ids=[r.request_id for r in batch], start_done=start_done, until=until or 0,
                   progress=[(r, d) for r, d in zip(batch, start_done) if r.progress])

    def book(self, rows: int, loads: int, peak: int | None, end: float) -> None:
        """Record one step of every request of the run: `rows` forward rows, `loads`
        components moved in, `peak` bytes (None: unmeasured), ending at `end` (seconds)."""
        self.steps += 1
        self.sizes[rows] = self.sizes.get(rows, 0) + 1
        self.loads += loads
        if peak is not None and (self.peak is None or peak > self.peak):
            self.peak = peak
        self.end = end

    def fold(self) -> None:
        """Add the run's steps to each request's metrics and ``steps_done``, when the run ends
        (a second call adds nothing)."""
        if not self.steps:
            return
        for request, done in zip(self.batch, self.start_done):
            m = request.metrics
            m.num_steps += self.steps
            m.offload_loads += self.loads
            if self.peak is not None and (m.request_peak_memory_bytes is None or self.peak > m.request_peak_memory_bytes):
                m.request_peak_memory_bytes = self.peak
            sizes = m.batch_sizes
            for rows, count in self.sizes.items():
                sizes[rows] = sizes.get(rows, 0) + count
            m.denoise_s = self.end - request.first_step_time
            request.steps_done = done + self.steps
        self.steps = 0
