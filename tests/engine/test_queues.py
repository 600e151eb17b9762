"""The request scheduler's queue policy (`RequestQueues`): admission, batch choice, fairness,
queue bound."""

from __future__ import annotations

import math

import pytest

from diffserve import EngineOverloadedError
from diffserve.core.sampling_params import SamplingParams
from diffserve.engine.queues import RequestQueues, padded_grid
from diffserve.engine.request import Phase, Request


def _req(seq, key="a", rows=2):
    return Request(request_id=str(seq), prompt="p", params=None, batch_key=key, rows=rows, seq=seq,
                   arrival_time=0.0)


def _admit(s: RequestQueues) -> list[Request]:
    """Admit, then mark the admitted requests prepared (what the engine does once their
    prepare work comes back): only denoising requests are stepped."""
    admitted = s.admit()
    for r in admitted:
        r.phase = Phase.DENOISING
    s.changed()
    return admitted


def test_steps_only_denoising_requests():
    s = RequestQueues(max_batch_size=6, max_waiting=10)
    for i in range(3):
        s.add(_req(i))
    admitted = s.admit()
    assert s.select_batch() == [] and s.running_rows == 6  # preparing: holds rows, not stepped
    admitted[1].phase = Phase.DENOISING
    admitted[2].phase = Phase.DECODING
    s.changed()
    assert s.select_batch() == [admitted[1]] and s.running_rows == 4  # decoding frees its rows


def test_batches_oldest_key_and_admits_fifo():
    s = RequestQueues(max_batch_size=6, max_waiting=10)
    for i, key in enumerate("abaa"):
        s.add(_req(i, key))
    admitted = _admit(s)
    assert [r.request_id for r in admitted] == ["0", "1", "2"]  # 6 rows: "3" must wait
    assert [r.request_id for r in s.select_batch()] == ["0", "2"]  # oldest's key "a"
    s.finish(admitted[0])
    assert [r.request_id for r in _admit(s)] == ["3"]
    assert [r.request_id for r in s.select_batch()] == ["1"]  # "b" is now the oldest running


def test_batches_by_step_key_too():
    """A request's step key (e.g. Wan 2.2's expert) changes while it runs; only requests of
    the oldest's (batch key, step key) share a step."""
    s = RequestQueues(max_batch_size=8, max_waiting=10)
    for i in range(3):
        s.add(_req(i))
    r0, r1, r2 = _admit(s)
    r1.step_key = 1
    s.changed()
    assert s.select_batch() == [r0, r2]
    r0.step_key = 1  # the oldest crossed to the other expert
    s.changed()
    assert s.select_batch() == [r0, r1]


def test_reuses_its_batch_until_something_changes():
    """An unchanged batch is returned as the same list (no per-request work per step); an
    admission, a finish or `changed` (a phase or step key moved) makes it select again."""
    s = RequestQueues(max_batch_size=4, max_waiting=10)
    for i in range(3):
        s.add(_req(i))
    r0, r1 = _admit(s)
    batch = s.select_batch()
    assert batch == [r0, r1] and s.select_batch() is batch
    r1.phase = Phase.DECODING
    assert s.select_batch() is batch  # not told: the engine calls `changed` after such a move
    s.changed()
    assert s.select_batch() == [r0]
    s.finish(r1)
    [r2] = _admit(s)
    assert s.select_batch() == [r0, r2]
    s.finish(r0)
    assert s.select_batch() == [r2]


def test_queue_bound():
    s = RequestQueues(max_batch_size=2, max_waiting=2)
    s.add(_req(0))
    s.add(_req(1))
    with pytest.raises(EngineOverloadedError):
        s.add(_req(2))


def test_no_request_starves_under_adversarial_arrivals():
    """A lone key-"b" request arrives behind a steady stream of key-"a" requests that would
    always form the bigger batch; it must still finish within a bounded number of steps."""
    s = RequestQueues(max_batch_size=8, max_waiting=1000)
    steps_left, seq = {}, 0

    def arrive(key):
        nonlocal seq
        r = _req(seq, key)
        s.add(r)
        steps_left[r.request_id] = 5
        seq += 1
        return r

    for _ in range(4):
        arrive("a")
    victim = arrive("b")
    done_at = None
    for step in range(200):
        for _ in range(2):
            arrive("a")  # adversary: more "a" work every step
        _admit(s)
        for r in s.select_batch():
            steps_left[r.request_id] -= 1
            if steps_left[r.request_id] == 0:
                s.finish(r)
                if r is victim:
                    done_at = step
        if done_at is not None:
            break
    assert done_at is not None and done_at < 20


def _lora_req(seq, loras, rows=2):
    request = _req(seq, rows=rows)
    request.params = SamplingParams(loras=loras)
    return request


@pytest.mark.parametrize("mode", ["step", "request"])
def test_lora_admission_waits_for_loads_and_slots(mode):
    """A request whose adapter is still loading is passed over (later requests go first); one
    that would need more distinct adapters than max_loras waits at the head (step mode); the
    running requests' adapters count until they finish."""
    ready = {"a", "b"}
    s = RequestQueues(max_batch_size=16, max_waiting=16, mode=mode, max_loras=1,
                      lora_ready=lambda names: set(names) <= ready)
    loading, plain, with_a, with_b, with_a2 = (_lora_req(0, {"c": 1.0}), _lora_req(1, None), _lora_req(2, {"a": 1.0}),
                                               _lora_req(3, {"b": 1.0}), _lora_req(4, {"a": 0.5}))
    for r in (loading, plain, with_a, with_b, with_a2):
        s.add(r)
    admitted = s.admit()
    if mode == "step":
        assert admitted == [plain, with_a]  # c is loading: passed over; b needs a second slot: waits at the head
    else:
        assert admitted == [plain, with_a, with_a2]  # one static batch: same key, one adapter at most
    assert s.admit() == []
    if mode == "step":
        s.finish(with_a)  # `a` is free again: with_b's adapter fits; with_a2 (a) waits behind it
        assert s.admit() == [with_b]
        ready.add("c")
        s.finish(with_b)
        assert s.admit() == [loading]  # c loaded: admitted in its place at the front
        s.finish(loading)
        assert s.admit() == [with_a2]
    else:
        for r in (plain, with_a, with_a2):
            s.finish(r)
        assert s.admit() == [with_b]
        ready.add("c")
        s.finish(with_b)
        assert s.admit() == [loading]


# ------------------------------------------------------------------ padding cap (max_padding_ratio)
def _sized(seq, row_tokens, rows=2, age_s=0.0):
    """A request of `rows` rows of `row_tokens` image tokens each, arrived `age_s` ago."""
    import time

    return Request(request_id=str(seq), prompt="p", params=None, batch_key="a", rows=rows, seq=seq,
                   arrival_time=time.perf_counter() - age_s, tokens=rows * row_tokens)


def _padded_share(batch):
    widest = max(r.row_tokens for r in batch)
    slots = sum(r.rows for r in batch) * widest
    return 1 - sum(r.tokens for r in batch) / slots


def _drain(s: RequestQueues, steps: int, arrivals=()):
    """Step `s` until every request finished (`steps` steps each), admitting `arrivals`
    ({step: [requests]}) on the way; returns every step's batch (as lists of requests)."""
    arrivals = dict(arrivals)
    left, batches = {}, []
    for step in range(1000):
        for r in arrivals.pop(step, ()):
            s.add(r)
        for r in _admit(s):
            left[r.request_id] = steps
        batch = list(s.select_batch())
        if not batch and not s.waiting and not arrivals:
            return batches
        batches.append(batch)
        for r in batch:
            left[r.request_id] -= 1
            if left[r.request_id] == 0:
                s.finish(r)
    raise AssertionError("requests starved")


MIX = [256, 128, 256, 64, 128, 256, 64, 256, 128, 128]  # image tokens per row, in arrival order


def test_padding_cap_zero_never_mixes_token_counts():
    s = RequestQueues(max_batch_size=8, max_waiting=100, max_padding_ratio=0.0)
    for i, t in enumerate(MIX):
        s.add(_sized(i, t))
    late = {3: [_sized(10 + i, t) for i, t in enumerate([64, 256, 128])]}
    batches = _drain(s, steps=4, arrivals=late)
    assert all(len({r.row_tokens for r in b}) == 1 for b in batches)
    assert s.batch_slots == s.batch_tokens  # the last forward: no padding
    assert {r.row_tokens for b in batches for r in b} == {64, 128, 256}


def test_padding_cap_one_is_todays_rule():
    """R = 1 on mixed token counts selects exactly the batches of the rule without a cap (the
    same requests at one token count, where no cap can bind)."""
    runs = []
    for cap, mix in ((1.0, MIX), (0.0, [128] * len(MIX))):
        s = RequestQueues(max_batch_size=8, max_waiting=100, max_padding_ratio=cap)
        for i, t in enumerate(mix):
            s.add(_sized(i, t))
        runs.append([[r.request_id for r in b] for b in _drain(s, steps=3)])
    assert runs[0] == runs[1]
    assert any(len({MIX[int(i)] for i in b}) > 1 for b in runs[0])  # sizes did mix
    # and the uncapped rule mixes token counts in one forward; the cap bounds them
    s = RequestQueues(max_batch_size=8, max_waiting=100, max_padding_ratio=0.3)
    for i, t in enumerate(MIX):
        s.add(_sized(i, t))
    batches = _drain(s, steps=3)
    assert all(_padded_share(b) <= 0.3 for b in batches)
    assert any(len({r.row_tokens for r in b}) > 1 for b in batches)  # 256 + 128 rows: share 0.25


def test_padding_cap_counts_video_grids_axis_by_axis():
    """Video rows pad each axis (frames, height, width) to the batch's largest (`Request.grid`):
    a wide short clip and a narrow long one of equal token counts pad to more than either, and
    the cap counts those slots."""
    import time

    def clip(seq, grid):
        return Request(request_id=str(seq), prompt="p", params=None, batch_key="a", rows=2, seq=seq,
                       arrival_time=time.perf_counter(), tokens=2 * math.prod(grid), grid=grid)

    assert padded_grid([(2, 4, 6), (3, 4, 4)]) == (3, 4, 6)
    for cap, together in ((0.3, False), (0.4, True)):  # padded share 1 - 4 x 48 / (4 x 72) = 0.33
        wide, long = clip(0, (2, 4, 6)), clip(1, (3, 4, 4))  # 48 tokens each; together a (3, 4, 6) grid: 72
        s = RequestQueues(max_batch_size=8, max_waiting=10, max_padding_ratio=cap)
        s.add(wide)
        s.add(long)
        _admit(s)
        batch = list(s.select_batch())
        assert (len(batch) == 2) is together, (cap, batch)
        if together:
            assert (s.batch_tokens, s.batch_slots) == (192, 288)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "slo"])
def test_padding_cap_never_starves(policy):
    """A small request behind a steady stream of large ones that always form the batch: under
    R = 0 it never fits beside them, yet it finishes (FCFS: it becomes the oldest; ranked
    policies: it ages past `aging_s`)."""
    s = RequestQueues(max_batch_size=8, max_waiting=1000, policy=policy, aging_s=0.05, max_padding_ratio=0.0)
    left, seq = {}, 0

    def arrive(tokens):
        nonlocal seq
        r = _sized(seq, tokens)
        r.params = SamplingParams()
        r.num_steps = 5
        s.add(r)
        left[r.request_id] = 5
        seq += 1
        return r

    for _ in range(3):
        arrive(256)
    victim = arrive(64)
    import time

    deadline = time.perf_counter() + 5.0
    while victim.request_id in left and time.perf_counter() < deadline:
        arrive(256)
        _admit(s)
        for r in s.select_batch():
            r.steps_done += 1
            left[r.request_id] -= 1
            if left[r.request_id] == 0:
                del left[r.request_id]
                s.finish(r)
        time.sleep(0.002)
    assert victim.request_id not in left


def test_padding_cap_exempts_aged_and_running_requests():
    s = RequestQueues(max_batch_size=8, max_waiting=100, aging_s=30.0, max_padding_ratio=0.0)
    head, small, old_small = _sized(0, 256), _sized(1, 64), _sized(2, 64, age_s=60.0)
    for r in (head, small, old_small):
        s.add(r)
    _admit(s)
    assert s.select_batch() == [head, old_small]  # aged: joins despite R = 0; `small` waits
    wide = _sized(3, 256)
    s.add(wide)
    _admit(s)
    assert s.select_batch() == [head, old_small, wide]  # at the widest size: lowers the share

    # running members are never evicted: A, B, C ran together (share 0.25 <= 0.3); L (passed
    # over: 0.375) is older than C, and with B gone C alone beside A would pad 0.375 too
    s = RequestQueues(max_batch_size=8, max_waiting=100, max_padding_ratio=0.3)
    a, l_, b, c = _sized(0, 256), _sized(1, 64), _sized(2, 256), _sized(3, 64)
    for r in (a, l_, b, c):
        s.add(r)
    _admit(s)
    assert s.select_batch() == [a, b, c]
    s.finish(b)
    assert s.select_batch() == [a, c]
    s.finish(a)  # a new head: the batch is built afresh
    assert s.select_batch() == [l_, c]


# ------------------------------------------------------------------ automatic padding decision
def _fitted(a: float, b: float):
    """A step cost model fitted exactly to seconds = a + b x token slots."""
    from diffserve.engine.cost_model import StepCostModel

    model = StepCostModel(decay=1.0)
    for slots in (100, 200, 400, 800):
        model.observe(slots, a + b * slots)
    return model


def test_slack_step_time_counts_at_most_a_batch_of_rows():
    """`step_seconds` (the slack's and --admission slo's step time) predicts a step of the
    denoising requests' tokens, but a step runs at most `max_batch_size` rows: requests
    preempted beside the batch (2 x the rows admitted under slo) do not lengthen it."""
    s = RequestQueues(max_batch_size=4, max_waiting=10, policy="slo", cost_model=_fitted(0.001, 1e-5))
    running = [_sized(i, 16) for i in range(4)]  # 4 requests x 2 rows x 16 tokens: 8 rows, 128 tokens
    for r in running:
        r.phase = Phase.DENOISING
    s.running.extend(running[:2])
    assert s.step_seconds() == pytest.approx(0.001 + 1e-5 * 64)  # 4 rows: all of them
    s.running.extend(running[2:])
    assert s.step_seconds() == pytest.approx(0.001 + 1e-5 * 64)  # 8 rows: a batch of 4 steps
    running[3].phase = Phase.DECODING
    assert s.step_seconds() == pytest.approx(0.001 + 1e-5 * (96 * 4 // 6))  # 6 rows of 16 tokens, 4 step


def test_auto_padding_follows_the_cost_model():
    """``max_padding_ratio="auto"``: a narrow row joins wide ones only if the predicted real
    tokens per second do not drop. Compute-bound (a = 0): 2 rows of 256 + 2 of 64 would be
    640 tokens in 1024 slots, 0.625 of the throughput: the narrow one waits, a wide one joins.
    Host-bound (a = 0.1 s, b = 1e-6 s/slot): the same rows cost 0.1005 s vs 0.1010 s for 1.25x
    the tokens: it joins. Before the first step (no fit) every request joins."""
    for model, expected in ((_fitted(0.0, 1e-3), [0, 2]), (_fitted(0.1, 1e-6), [0, 1, 2]), (None, [0, 1, 2])):
        s = RequestQueues(max_batch_size=8, max_waiting=100, max_padding_ratio="auto", cost_model=model)
        for r in (_sized(0, 256), _sized(1, 64), _sized(2, 256)):
            s.add(r)
        _admit(s)
        assert [int(r.request_id) for r in s.select_batch()] == expected


def test_auto_padding_on_a_padding_free_model_counts_real_tokens():
    """Length groups (``padding_free``): padding costs no compute, so ``auto`` passes nobody over
    even on a compute-bound fit, and the cost model is fed real tokens, not slots."""
    s = RequestQueues(max_batch_size=8, max_waiting=100, max_padding_ratio="auto", cost_model=_fitted(0.0, 1e-3),
                      padding_free=True)
    for r in (_sized(0, 256), _sized(1, 64), _sized(2, 256)):
        s.add(r)
    _admit(s)
    assert [int(r.request_id) for r in s.select_batch()] == [0, 1, 2]
    assert (s.batch_tokens, s.batch_slots, s.cost_tokens) == (576 * 2, 768 * 2, 576 * 2)  # 2 CFG rows each
    padded = RequestQueues(max_batch_size=8, max_waiting=100)
    for r in (_sized(0, 256), _sized(1, 64)):
        padded.add(r)
    _admit(padded)
    padded.select_batch()
    assert padded.cost_tokens == padded.batch_slots == 256 * 4


def test_auto_padding_exempts_aged_requests_and_ends_at_the_head():
    """A row auto passes over is not starved: once aged it joins; and when the wide rows are
    done it leads its own batch."""
    s = RequestQueues(max_batch_size=8, max_waiting=100, aging_s=30.0, max_padding_ratio="auto",
                      cost_model=_fitted(0.0, 1e-3))
    wide, narrow, old_narrow = _sized(0, 256), _sized(1, 64), _sized(2, 64, age_s=60.0)
    for r in (wide, narrow, old_narrow):
        s.add(r)
    _admit(s)
    assert s.select_batch() == [wide, old_narrow]  # fcfs order; `narrow` waits
    s.finish(wide)
    assert s.select_batch() == [narrow, old_narrow]  # equal token counts: no padding


# ------------------------------------------------------------------ memory budget sees padding
SLOT = 10  # estimated activation bytes per image-token slot in the tests below
FIXED = 1000  # each request's part of its estimate that does not grow with tokens


def _budgeted(seq, row_tokens, rows=2, age_s=0.0):
    """`_sized` with a memory estimate: FIXED + SLOT bytes per image token."""
    r = _sized(seq, row_tokens, rows, age_s)
    r.token_bytes = SLOT * r.tokens
    r.memory_bytes = FIXED + r.token_bytes
    return r


def _padding(batch):
    """Bytes the padding of `batch` costs (every member at SLOT bytes a slot)."""
    widest = max(r.row_tokens for r in batch)
    return SLOT * (sum(r.rows for r in batch) * widest - sum(r.tokens for r in batch))


def test_slot_bytes_round_up():
    r = _budgeted(0, 64)
    assert r.slot_bytes == SLOT
    r.token_bytes += 1
    assert r.slot_bytes == SLOT + 1
    assert _sized(1, 0).slot_bytes == 0


def test_memory_limit_keeps_a_small_request_out_of_a_large_forward():
    """Both requests fit by their own estimates; with the small one's rows padded to the large
    one's they do not: it runs after the large one (no starvation) and never beside it. With
    room for the padding they share the forward, as without a memory limit."""
    large, small = _budgeted(0, 256), _budgeted(1, 64)
    own = large.memory_bytes + small.memory_bytes
    pad = _padding([large, small])
    assert pad == SLOT * 2 * (256 - 64)
    for limit, together in ((own + pad - 1, False), (own + pad, True), (None, True)):
        s = RequestQueues(max_batch_size=8, max_waiting=10, memory_limit=limit)
        large, small = _budgeted(0, 256), _budgeted(1, 64)
        s.add(large)
        s.add(small)
        batches = _drain(s, steps=3)
        if together:
            assert batches == [[large, small]] * 3
        else:  # both admitted at once (each at its own size); the small one waits for the forward
            assert batches == [[large]] * 3 + [[small]] * 3


@pytest.mark.parametrize("policy", ["fcfs", "priority", "slo"])
@pytest.mark.parametrize("cap", [1.0, 0.5])
def test_memory_limit_holds_with_padding_and_nothing_starves(policy, cap):
    """Mixed sizes arriving over time under a tight limit (about three requests' worth): every
    forward's estimate (the running requests' plus its padding) stays within the limit, sizes
    still mix where they fit, and every request finishes."""
    limit = 3 * (FIXED + SLOT * 2 * 256)
    s = RequestQueues(max_batch_size=8, max_waiting=100, memory_limit=limit, policy=policy, max_padding_ratio=cap)
    arrivals = {0: [_budgeted(i, t) for i, t in enumerate(MIX[:6])],
                4: [_budgeted(10 + i, t) for i, t in enumerate(MIX[6:])]}
    for r in (*arrivals[0], *arrivals[4]):
        r.params = SamplingParams()
        r.num_steps = 3
    seen, peaks, mixed = set(), [], False
    left = {}
    for step in range(500):
        for r in arrivals.pop(step, ()):
            s.add(r)
        for r in _admit(s):
            left[r.request_id] = 3
        batch = list(s.select_batch())
        if not batch and not s.waiting and not arrivals:
            break
        assert s.padding_bytes == (_padding(batch) if batch else 0)
        peaks.append(s.running_memory + s.padding_bytes)
        mixed |= len({r.row_tokens for r in batch}) > 1
        for r in batch:
            r.steps_done += 1
            left[r.request_id] -= 1
            if left[r.request_id] == 0:
                seen.add(r.request_id)
                s.finish(r)
    assert len(seen) == len(MIX)
    assert max(peaks) <= limit
    assert mixed  # 128-token rows beside 256-token ones fit the limit


def test_admission_counts_the_running_forward_padding():
    """A waiting request that fits beside the running requests' own estimates but not beside
    their forward's padding waits until that forward's padding is gone."""
    large, small = _budgeted(0, 256), _budgeted(1, 64)
    pad = _padding([large, small])
    newcomer = _budgeted(2, 64)
    limit = large.memory_bytes + small.memory_bytes + pad + newcomer.memory_bytes - 1
    s = RequestQueues(max_batch_size=8, max_waiting=10, memory_limit=limit)
    s.add(large)
    s.add(small)
    _admit(s)
    assert s.select_batch() == [large, small] and s.padding_bytes == pad
    s.add(newcomer)
    assert _admit(s) == []  # its own bytes fit beside the estimates, not beside the padding
    s.finish(large)
    assert s.select_batch() == [small] and s.padding_bytes == 0
    assert _admit(s) == [newcomer]
    assert s.select_batch() == [small, newcomer]
