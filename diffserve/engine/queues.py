"""`RequestQueues`: the request scheduler's policy: which requests are admitted and which run
in the next denoising step (`diffserve.engine.scheduler.RequestScheduler` drives it).

Two queues: `waiting` (added, not yet admitted) and `running` (admitted: being prepared,
denoising or being decoded). Only denoising requests are stepped; preparing and denoising ones
count against the row budget.

Fairness rule (step mode):
- Admission is first-come-first-served: waiting requests enter `running` in arrival order
  while the running rows stay within `max_batch_size` (a request bigger than that runs alone
  when nothing else is running). Nobody is overtaken at admission, so no one starves there.
- Each step runs the batch key of the OLDEST running request, with every other running
  request of that key (oldest first, up to `max_batch_size` rows). The key is the request's
  static `batch_key` plus its current `step_key` (the part that changes while it runs, e.g.
  Wan 2.2's expert). The oldest request
  advances every step until it finishes, so every request eventually becomes the oldest and
  runs: no starvation, and an incompatible request never stalls compatible ones for longer
  than its own remaining steps.

Scheduling policies (step mode; `policy`):
- ``fcfs`` (default): the rule above.
- ``priority``: requests are ranked by ``SamplingParams.priority`` (lower first, then arrival).
  Admission takes waiting requests in rank order; each step runs the best-ranked denoising
  request's key with the next best of that key up to `max_batch_size` rows. A waiting request
  that outranks a running one is admitted even when the rows are taken (up to
  `PREEMPT_HEADROOM` x `max_batch_size` rows held): the running one is then *preempted* at the
  step boundary: left out of the step, its state kept in the worker, resumed later exactly
  where it stopped (no recompute).
- ``slo``: ranked by least slack: ``deadline - now - remaining steps x predicted step time``
  (a stream's remaining steps count its chunks still to come, `Request.remaining_steps`)
  (`cost_model.StepCostModel`, fitted online on the steps run; before the first step: earliest
  deadline first); requests without a deadline, and those whose slack is already negative
  (they miss their deadline whatever runs: serving them first would make others miss theirs
  too), after those that can still meet theirs, by priority then arrival. Admission and
  preemption as under ``priority``. Deadline-aware batch size: once the cost model has seen a
  step, the batch is not always filled to `max_batch_size`: of the filled batch (least-slack
  order) it runs the prefix predicted to let the most requests meet their deadlines (a member
  at the prefix's step time, one left out after the prefix's last member, at the full batch's;
  ties to the larger prefix), keeping the previous step's members unless dropping them meets
  strictly more deadlines (`RequestQueues._deadline_prefix`). So on a compute-bound device
  (a step costing its token slots) an urgent request runs in a smaller, faster batch. While a
  batch holds a request with a deadline it is re-selected every step.
- Aging (both): a request that arrived more than `aging_s` seconds ago ranks before every
  younger one, in arrival order among themselves. So a request waits at most `aging_s` plus
  what FCFS would make it wait behind the requests older than it: nothing starves.

Padding cap (step mode, every policy; `max_padding_ratio` R in [0, 1], 1 = off): rows of
different sizes in one forward are padded to its widest row (`Request.row_grid`: the longest
token sequence, or for video the largest of each axis: frames, height, width), so a forward's
padded share is ``1 - image tokens / (rows x padded row's tokens)``. When a step batch
is filled, a candidate whose joining would make that share exceed R (and raise it) is passed
over for this batch: it stays admitted, its rows and worker state kept, and runs in a later
batch. Exempt, so nothing starves and a newcomer never evicts a running request: the head of the order (the
oldest request under ``fcfs``, the best-ranked otherwise), a request that arrived more than
`aging_s` seconds ago, and, while the previous step's head still leads, the members of that
step. The exempt rows count at their widest from the start of the fill, so the share holds
against them too, unless an exempt request itself exceeds it. When the head changes (it
finished, or a better-ranked one preempted it), the batch is built afresh under the cap, so
with R = 0 rows of different token counts never share a forward (aged requests aside). Under
``fcfs`` the head advances every step until it finishes, so a passed-over request waits at
most for the requests older than it (then it is the head); under the ranked policies, aging
bounds it.

Automatic padding decision (`max_padding_ratio` ``"auto"``): no fixed R; a candidate joins
only if the step cost model (`cost_model.StepCostModel.predict`: step seconds about a + b x
token slots, interpolated between observed steps) predicts no fewer real image tokens per
second for the forward with it than without:
``(tokens + its tokens) x predict(slots) >= tokens x predict(slots with it)``. Where rows
are nearly free (a large against b x slots: host-bound) sizes mix; where a forward costs its
slots (a small: compute-bound) a narrower row joins only if it fills its slots at least as well
as the batch does. Same exemptions as the cap; before the first step every request joins.
Where the model's mixed-size forwards compute real tokens only (``padding_free``: length
groups in eager forwards) padding costs no compute, the cost model counts real tokens and
``"auto"`` passes nobody over for padding (the memory budget still counts it).

Request mode (static batching, the baseline): when nothing runs, the head of the queue and
every waiting request sharing its batch key (up to `max_batch_size` rows) are admitted
together and run to completion before anything else is admitted.

Memory (with a `memory_limit`, see `diffserve.engine.memory_budget`): in both modes a request
is admitted only while the estimated bytes (`Request.memory_bytes`) of the running requests
(decoding ones included), plus the padding of the last step batch, plus its own stay within
the limit; like rows, a request that does not fit waits at the head of the queue.
Padding: each request counts its rows at its own size, but a row padded to a wider one in a
mixed-size forward holds the wider one's activations. Per padded token slot that costs
`Request.slot_bytes` (the size-proportional part of its estimate, `Request.token_bytes`, per
image token), so a step batch's padding costs ``slot bytes x (token slots - image tokens)``
(the largest slot bytes of its members; plain integers). When a step batch is filled, a
candidate joins only while the running requests' estimates plus that padding of the forward
with it stay within the limit; otherwise it is passed over for this batch (kept admitted, it
runs in a later one). Exempt, so nothing starves: the head of the order and, while the
previous step's head still leads, the members of that step (admission counted their padding);
the exempt rows count at their widest from the start. A passed-over request waits at most
until it is the head (fcfs: the requests older than it finish; ranked: aging bounds it).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from diffserve.engine.request import Phase, Request
from diffserve.core.errors import EngineOverloadedError
from diffserve.engine.cost_model import StepCostModel

#: Under ``priority`` / ``slo``, admission may hold up to this many times `max_batch_size` rows
#: (the extra rows are preempted requests waiting at a step boundary, their state kept).
PREEMPT_HEADROOM = 2
#: Under ``slo``, a request in the current step batch counts its slack this many (predicted)
#: steps smaller when the batch is rebuilt: preemption needs a clear difference in urgency.
PREEMPT_MARGIN_STEPS = 4


def padded_grid(grids: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """The grid rows of `grids` pad to in one forward: the largest of each axis (() for none;
    ``()`` entries are ignored)."""
    grids = [g for g in grids if g]
    return tuple(max(axis) for axis in zip(*grids)) if grids else ()


class RequestQueues:
    """Waiting/running queues, admission and the per-step batch choice (the fairness rule of
    the module docstring).

    Args:
        max_batch_size: most transformer rows per step (and admitted at once).
        max_waiting: bound on the waiting queue.
        mode: ``"step"`` or ``"request"``.
        memory_limit: bytes the running requests' estimates may add up to (None = no memory
            budget).
        max_loras: most distinct LoRA adapters the running requests may use (the workers'
            device slots; None = no bound).
        lora_ready: whether the workers hold every named adapter (None = always); a request
            whose adapters are still loading is passed over at admission.
        policy: ``"fcfs"``, ``"priority"`` or ``"slo"`` (the module docstring; step mode).
        aging_s: the aging bound of ``priority`` / ``slo`` and of the padding cap, in seconds.
        cost_model: the step-time model ``slo`` ranks with (a fresh one when None).
        max_padding_ratio: the padding cap R in [0, 1] (the module docstring; 1 = off), or
            ``"auto"``: the automatic padding decision from `cost_model` (the module docstring).
        clock: returns the current time in seconds, on the clock of `Request.arrival_time`
            (default `time.perf_counter`, the engine's; a discrete-event simulation passes its
            virtual clock, `benchmarks/slo_simulation.py`). Read for aging, slack and the
            padding cap's re-check.
        padding_free: whether the model's mixed-size forwards compute real tokens only
            (`ModelInfo.padding_free`): the cost model then fits step time on real tokens
            (`cost_tokens`) and ``"auto"`` never passes a request over for its padding.
    """

    def __init__(self, max_batch_size: int, max_waiting: int, mode: str = "step",
                 memory_limit: int | None = None, max_loras: int | None = None,
                 lora_ready: Callable[[Iterable[str]], bool] | None = None, policy: str = "fcfs",
                 aging_s: float = 60.0, cost_model: StepCostModel | None = None,
                 max_padding_ratio: float | str = 1.0, clock: Callable[[], float] = time.perf_counter,
                 padding_free: bool = False):
        self.clock = clock
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.mode = mode
        self.memory_limit = memory_limit
        self.max_loras = max_loras
        self.lora_ready = lora_ready
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: the last `select_batch` result, reused until something it depends on changes
        self._batch: list[Request] | None = None
        self.policy = policy if mode == "step" else "fcfs"
        self.aging_s = aging_s
        self.cost_model = cost_model or StepCostModel()
        self.max_padding_ratio = max_padding_ratio
        self.padding_free = padding_free
        #: image tokens of the last selected batch (`Request.tokens` summed)
        self.batch_tokens = 0
        #: token slots of the last selected batch: its rows x its widest row's image tokens
        self.batch_slots = 0
        #: estimated bytes the padding of the last selected batch adds (memory budget; 0 without)
        self.padding_bytes = 0
        #: fcfs with the padding cap: when a request the cap passed over ages (re-select then)
        self._recheck_at: float | None = None
        #: requests left out of a step they were running in (priority / slo)
        self.preemptions = 0
        #: ranked policies: some denoising request was left out of the batch (re-rank each tick)
        self._contended = False
        #: ranked policies: the previous selected batch (preemptions are counted against it)
        self._last: list[Request] | None = None

    def changed(self) -> None:
        """Forget the last selected batch: a running request's phase or step key changed
        (the request scheduler calls this; admission and `finish` call it themselves)."""
        self._batch = None

    @property
    def running_rows(self) -> int:
        """Denoiser rows held by admitted requests that are preparing or denoising."""
        return sum(r.rows for r in self.running if r.phase is not Phase.DECODING)

    @property
    def running_memory(self) -> int:
        """Estimated bytes of every admitted request (`Request.memory_bytes`)."""
        return sum(r.memory_bytes for r in self.running)

    def _fits_memory(self, used: int, request: Request) -> bool:
        return self.memory_limit is None or used + request.memory_bytes <= self.memory_limit

    def add(self, request: Request, bounded: bool = True) -> None:
        """Queue a request.

        Args:
            bounded: check the bound (False: a request counted against it already, when it
                entered its model's AR stage).

        Raises:
            EngineOverloadedError: the waiting queue already holds `max_waiting` requests.
        """
        if bounded and len(self.waiting) >= self.max_waiting:
            raise EngineOverloadedError(
                f"waiting queue is full ({self.max_waiting} requests); retry later"
            )
        self.waiting.append(request)

    def remove_waiting(self, request_id: str) -> Request | None:
        """Take a waiting request out of the queue (abort); None if it is not waiting."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None

    def admit(self) -> list[Request]:
        """Move waiting requests into `running` per the mode's rule; returns those moved.

        LoRA adapters (`SamplingParams.loras`): a request whose adapters the workers are still
        loading is passed over (it keeps its place; later requests may be admitted); one whose
        adapters would make the running requests use more than `max_loras` distinct adapters
        waits at the head, like rows and memory."""
        admitted: list[Request] = []
        in_use: set[str] | None = None

        def loras_fit(request: Request) -> bool | None:
            """None: its adapters are loading (pass over it); else whether they fit the slots."""
            nonlocal in_use
            names = request.lora_names
            if not names:
                return True
            if self.lora_ready is not None and not self.lora_ready(names):
                return None
            if self.max_loras is None:
                return True
            if in_use is None:
                in_use = {n for r in self.running for n in r.lora_names}
            return len(in_use | set(names)) <= self.max_loras

        def take(index: int) -> Request:
            request = self.waiting[index]
            del self.waiting[index]
            admitted.append(request)
            if in_use is not None:
                in_use.update(request.lora_names)
            return request

        if self.mode == "request":
            if self.running or not self.waiting:
                return admitted
            start = next((i for i, r in enumerate(self.waiting) if loras_fit(r)), None)
            if start is None:
                return admitted
            head = take(start)
            rows, memory = head.rows, head.memory_bytes
            i = start
            while i < len(self.waiting):
                request = self.waiting[i]
                if request.batch_key == head.batch_key and rows + request.rows <= self.max_batch_size \
                        and self._fits_memory(memory, request) and loras_fit(request):
                    take(i)
                    rows += request.rows
                    memory += request.memory_bytes
                else:
                    i += 1
        elif self.waiting and self.policy != "fcfs":
            self._admit_ranked(take, loras_fit)
        elif self.waiting:
            rows, memory = self.running_rows, self.running_memory + self.padding_bytes
            i = 0
            while i < len(self.waiting):
                head = self.waiting[i]
                fit = loras_fit(head)
                if fit is None:
                    i += 1
                    continue
                if (self.running or admitted) and (not fit or rows + head.rows > self.max_batch_size
                                                   or not self._fits_memory(memory, head)):
                    break
                take(i)
                rows += head.rows
                memory += head.memory_bytes
        if admitted:
            self.running.extend(admitted)
            self._batch = None
        return admitted

    # ------------------------------------------------------------------ ranked policies
    def rank(self, request: Request, now: float, step_s: float | None, stepping: bool = False) -> tuple:
        """Sort key of `request` under the ranked policies (smaller = served first): aged
        requests first in arrival order, then by priority (``priority``) or slack (``slo``;
        `step_s`: the predicted seconds of a step, None = unknown: earliest deadline first).

        `stepping` (a member of the previous step's batch) is the hysteresis that keeps a batch
        from thrashing: among equal priorities it ranks first, and under ``slo`` its slack
        counts `PREEMPT_MARGIN_STEPS` steps smaller, so a newcomer preempts it only when
        clearly more urgent (not when the cost model's estimate jitters)."""
        if now - (request.ar_end_time or request.arrival_time) > self.aging_s:
            return (0, 0.0, 0, 0, request.seq)
        priority = request.params.priority
        member = 0 if stepping else 1
        if self.policy == "priority":
            return (1, 0.0, priority, member, request.seq)
        deadline = request.params.deadline_s
        if deadline is None:
            return (2, 0.0, priority, member, request.seq)
        step = step_s or 0.0
        slack = request.arrival_time + deadline - now - request.remaining_steps * step
        if slack < 0:  # it will miss its deadline anyway: after those that can still make theirs
            return (2, 0.0, priority, member, request.seq)
        if stepping:
            slack -= PREEMPT_MARGIN_STEPS * step
        return (1, slack, priority, member, request.seq)

    def step_seconds(self) -> float | None:
        """The cost model's prediction of a step at the current load (the running requests'
        tokens, at most a batch's worth), or None before the first step."""
        denoising = [r for r in self.running if r.phase is Phase.DENOISING]
        tokens = sum(r.tokens for r in denoising)
        rows = sum(r.rows for r in denoising)
        if rows > self.max_batch_size:  # preempted requests wait beside the batch: a step runs a batch's worth
            tokens = tokens * self.max_batch_size // rows
        return self.cost_model.predict(tokens)

    def predict_latency(self, request: Request) -> tuple[float, float, float] | None:
        """``--admission slo``'s prediction for `request` arriving now (not yet added): its own
        steps (a stream's: every chunk's, `Request.remaining_steps`) at the load it would join
        (the running requests' tokens plus its own); when its rows do not fit beside the
        running ones ahead of it, plus the steps of the work ahead of it (their rows x
        remaining steps, `max_batch_size` rows a step). Ahead of it: under ``fcfs`` every
        running and waiting request; under ``priority`` / ``slo`` only those that rank before
        it (`rank`, running ones with their hysteresis), since it is admitted past and
        preempts the others.

        Returns:
            (predicted seconds, predicted seconds of one step, steps of work ahead), or None
            before the cost model has seen a step.
        """
        active = [r for r in self.running if r.phase is not Phase.DECODING]
        step = self.cost_model.predict(sum(r.tokens for r in active) + request.tokens)
        if step is None:
            return None
        running, waiting = active, list(self.waiting)
        if self.policy != "fcfs":
            now = self.clock()
            step_s = self.step_seconds() if self.policy == "slo" else None
            mine = self.rank(request, now, step_s)
            running = [r for r in active if self.rank(r, now, step_s, stepping=True) < mine]
            waiting = [r for r in waiting if self.rank(r, now, step_s) < mine]
        ahead = 0.0
        if sum(r.rows for r in running) + request.rows > self.max_batch_size:
            work = sum(r.rows * r.remaining_steps for r in (*running, *waiting))
            ahead = work / self.max_batch_size
        return step * (request.remaining_steps + ahead), step, ahead

    def _admit_ranked(self, take: Callable[[int], Request], loras_fit: Callable[[Request], bool | None]) -> None:
        """Admission under ``priority`` / ``slo``: waiting requests in rank order while their rows
        fit; past `max_batch_size`, one that outranks the worst-ranked running request is still
        admitted (up to `PREEMPT_HEADROOM` x rows): the step batch then preempts that one."""
        now = self.clock()
        step_s = self.step_seconds() if self.policy == "slo" else None
        ranked = sorted(self.waiting, key=lambda r: self.rank(r, now, step_s))
        rows, memory = self.running_rows, self.running_memory + self.padding_bytes
        worst = max((self.rank(r, now, step_s) for r in self.running if r.phase is not Phase.DECODING),
                    default=None)
        for head in ranked:
            fit = loras_fit(head)
            if fit is None:
                continue
            if self.running or rows:
                if not fit or not self._fits_memory(memory, head):
                    break
                if rows + head.rows > self.max_batch_size:
                    outranks = worst is not None and self.rank(head, now, step_s) < worst
                    if not outranks or rows + head.rows > PREEMPT_HEADROOM * self.max_batch_size:
                        break
            take(next(i for i, r in enumerate(self.waiting) if r is head))
            rows += head.rows
            memory += head.memory_bytes

    def _select_ranked(self) -> list[Request]:
        """`select_batch` under ``priority`` / ``slo``: the best-ranked denoising request's key,
        then the next best of that key up to `max_batch_size` rows; the previous list object when
        the members are unchanged (so its `StepRun` continues)."""
        denoising = [r for r in self.running if r.phase is Phase.DENOISING]
        if not denoising:
            self._contended = False
            return []
        now = self.clock()
        step_s = self.step_seconds() if self.policy == "slo" else None
        stepping = set(map(id, self._last or ()))
        denoising.sort(key=lambda r: self.rank(r, now, step_s, id(r) in stepping))
        batch = full = self._fill(denoising, now)
        if self.policy == "slo" and len(batch) > 1:
            batch = self._deadline_prefix(batch, now, stepping)
        # re-select every tick while someone is left out, or while the batch size is the
        # deadline rule's choice (time passes: the best prefix can change without any event)
        self._contended = len(batch) < len(denoising) or (
            self.policy == "slo" and len(full) > 1 and any(r.params.deadline_s is not None for r in full))
        previous = self._last
        if previous is not None and len(previous) == len(batch) and all(a is b for a, b in zip(previous, batch)):
            return previous
        if previous:
            members = set(map(id, batch))
            for request in previous:
                if id(request) not in members and request.phase is Phase.DENOISING:
                    self.preemptions += 1
                    request.metrics.preemptions += 1
        return batch

    def _deadline_prefix(self, batch: list[Request], now: float, stepping: set[int]) -> list[Request]:
        """``slo``'s deadline-aware batch size: the prefix of `batch` (a filled step batch in
        least-slack order) predicted to let the most requests meet their deadlines.

        For each prefix length k (the head always runs), with the cost model's prediction for
        the prefix's token slots (rows x its widest row's tokens; its real tokens where the
        model's forwards are `padding_free`, as the cost model counts them; `predict`): a
        member finishes at ``now + its remaining steps x predict(slots_k)``; a candidate left out waits until the
        prefix's last member finishes, then runs at the full batch's step time. A candidate
        with a deadline counts when it finishes by it; one already hopeless (it misses even
        alone: remaining steps x its solo step time beyond its deadline) and one without a
        deadline count for no k. Ties go to the larger k (throughput). Hysteresis: a prefix
        that leaves out a member of the previous step is chosen only when it meets strictly
        more deadlines than every prefix keeping them all. Unchanged before the cost model's
        first step. O(len(batch)^2) plain arithmetic (len(batch) <= `max_batch_size`)."""
        predict = self.cost_model.predict
        if self.cost_model.coefficients() is None:
            return batch
        n = len(batch)
        step = []  # predicted seconds of a step of each prefix (index k - 1)
        rows, tokens, widest = 0, 0, ()
        for request in batch:
            rows += request.rows
            tokens += request.tokens
            widest = padded_grid((widest, request.row_grid))
            step.append(predict(tokens if self.padding_free else rows * math.prod(widest)))
        left: list[float | None] = []  # seconds to its deadline; None: no deadline, or hopeless
        for request in batch:
            deadline = request.params.deadline_s
            due = None if deadline is None else request.arrival_time + deadline - now
            solo = request.remaining_steps * predict(request.tokens if self.padding_free
                                                     else request.rows * math.prod(request.row_grid))
            left.append(due if due is not None and due >= solo else None)
        if not any(x is not None for x in left):
            return batch
        met = [0] * (n + 1)  # met[k]: deadlines met with the prefix of length k
        for k in range(1, n + 1):
            wait = max(r.remaining_steps for r in batch[:k]) * step[k - 1]
            for i, (request, due) in enumerate(zip(batch, left)):
                if due is None:
                    continue
                finish = request.remaining_steps * step[k - 1] if i < k \
                    else wait + request.remaining_steps * step[n - 1]
                met[k] += finish <= due
        keep = 1 + max((i for i, r in enumerate(batch) if id(r) in stepping), default=0)
        best = max(range(1, n + 1), key=lambda k: (met[k], k))
        kept = max(range(keep, n + 1), key=lambda k: (met[k], k))
        k = best if met[best] > met[kept] else kept
        return batch if k == n else batch[:k]

    def _fill(self, ordered: list[Request], now: float) -> list[Request]:
        """The first request of `ordered`, then the next ones with its (batch key, step key), in
        order, while they fit in `max_batch_size` rows (the first always included) and, with
        the padding cap, keep the forward's padded share within `max_padding_ratio` (exempt:
        the first, aged requests, and members of the previous step's batch while its head
        leads; the module docstring); under ``"auto"``, while the cost model predicts no fewer
        real image tokens per second with the candidate than without; with a `memory_limit`,
        while the running requests' estimates plus the forward's padding bytes stay within it
        (exempt: the first and the previous step's members while its head leads; the module
        docstring). O(len(ordered)), plain arithmetic."""
        key = (ordered[0].batch_key, ordered[0].step_key)
        auto = self.max_padding_ratio == "auto"
        cap = 1.0 if auto else self.max_padding_ratio
        capped = auto or cap < 1.0
        # auto: the cost model's prediction over token slots (before the first step: no bound)
        predict = self.cost_model.predict if auto and self.cost_model.coefficients() is not None else None
        # the previous step's members, while its head leads again (a new head rebuilds the batch)
        previous = set(map(id, self._last)) if capped and self._last and self._last[0] is ordered[0] else ()
        aged_before = now - self.aging_s

        def exempt(request: Request) -> bool:
            return (request is ordered[0] or id(request) in previous
                    or (request.ar_end_time or request.arrival_time) < aged_before)

        widest: tuple[int, ...] = ()  # the padded row's grid, counting the exempt rows that will join
        if capped:
            widest = padded_grid(r.row_grid for r in ordered if (r.batch_key, r.step_key) == key and exempt(r))
        # memory: the padding bytes the forward may add beside the running requests' estimates
        keyed = [r for r in ordered if (r.batch_key, r.step_key) == key] if self.memory_limit is not None else []
        slot_bytes = max((r.slot_bytes for r in keyed), default=0)
        if slot_bytes:
            spare = self.memory_limit - self.running_memory
            held = set(map(id, self._last)) if self._last and self._last[0] is ordered[0] else ()
            fixed = [r for r in keyed if r is ordered[0] or id(r) in held]  # join whatever it costs
            fixed_ids = set(map(id, fixed))
            mem_grid = padded_grid(r.row_grid for r in fixed)  # the fixed rows and those joined so far
            mem_rows, mem_tokens = sum(r.rows for r in fixed), sum(r.tokens for r in fixed)
        self._recheck_at = None
        batch: list[Request] = []
        rows = tokens = 0
        for request in ordered:
            if (request.batch_key, request.step_key) != key:
                continue
            if batch and rows + request.rows > self.max_batch_size:
                continue
            grid = padded_grid((widest, request.row_grid)) if capped else widest  # no cap: unused
            if capped and batch and not exempt(request):
                slots = (rows + request.rows) * math.prod(grid)  # the forward's token slots with it
                slots_before = rows * math.prod(widest) if widest else 0
                if auto and self.padding_free:  # padding costs no compute: never passed over for it
                    drops = False
                elif auto:  # passed over: fewer real tokens per predicted second with it
                    drops = predict is not None and (tokens + request.tokens) * predict(slots_before) \
                        < tokens * predict(slots)
                else:  # passed over: past the cap, and more padded than the batch so far (a row at
                    # the widest size lowers the share: it joins even when exempt rows exceed the cap)
                    padded = slots - tokens - request.tokens
                    raises = padded * slots_before > (slots_before - tokens) * slots if slots_before else padded > 0
                    drops = padded > cap * slots and raises
                if drops:
                    ages_at = (request.ar_end_time or request.arrival_time) + self.aging_s
                    self._recheck_at = ages_at if self._recheck_at is None else min(self._recheck_at, ages_at)
                    continue
            if slot_bytes and id(request) not in fixed_ids:
                joined_grid = padded_grid((mem_grid, request.row_grid))
                slots = (mem_rows + request.rows) * math.prod(joined_grid)
                if slot_bytes * (slots - mem_tokens - request.tokens) > spare:
                    continue  # its padding would take the forward past the memory limit
                mem_grid, mem_rows, mem_tokens = joined_grid, mem_rows + request.rows, mem_tokens + request.tokens
            widest = grid
            batch.append(request)
            rows += request.rows
            tokens += request.tokens
        return batch

    def _set_batch(self, batch: list[Request]) -> list[Request]:
        """Remember `batch` as the selected one, with its tokens and token slots."""
        self._batch = self._last = batch
        self.batch_tokens = sum(r.tokens for r in batch)
        grid = padded_grid(r.row_grid for r in batch)
        self.batch_slots = sum(r.rows for r in batch) * math.prod(grid) if grid else 0
        self.padding_bytes = max((r.slot_bytes for r in batch), default=0) * (self.batch_slots - self.batch_tokens)
        return batch

    @property
    def cost_tokens(self) -> int:
        """The load of the last selected batch as the step cost model counts it: its token
        slots (a padded forward computes them all), or its real tokens when the model's
        forwards are `padding_free`."""
        return self.batch_tokens if self.padding_free else self.batch_slots

    def select_batch(self) -> list[Request]:
        """Requests for the next denoising step: the oldest denoising request's (batch key,
        step key), oldest first, up to `max_batch_size` rows (the oldest always included),
        within the padding cap (`_fill`).

        While nothing it depends on changed (no admission, `finish` or `changed` since, and no
        request the padding cap passed over has aged), the previous call's list is returned
        again, as is (the same object: callers must not modify it), so a step of an unchanged
        batch costs no per-request work here."""
        if self._batch is not None and not self._contended and (
                self._recheck_at is None or self.clock() < self._recheck_at):
            return self._batch
        if self.policy != "fcfs":
            return self._set_batch(self._select_ranked())
        ordered = sorted((r for r in self.running if r.phase is Phase.DENOISING), key=lambda r: r.seq)
        if not ordered:
            self._recheck_at = None
            self.padding_bytes = 0
            return []
        return self._set_batch(self._fill(ordered, self.clock()))

    def finish(self, request: Request) -> None:
        """Remove a request from `running` (finished, failed or aborted)."""
        if request in self.running:
            self.running.remove(request)
            self._batch = None
            if not self.running:
                self.padding_bytes = 0
