"""Scheduling policies (`diffserve.engine.queues`: fcfs, priority, slo), step-boundary
preemption, aging, the step cost model, ``--admission slo`` and the scheduler's counters.

The queue rules run on plain `Request`s (no model); the end-to-end checks on the built-in
digits model with a small batch size."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.core.errors import DeadlineUnmeetableError, InvalidRequestError
from diffserve.core.sampling_params import ModelSpec, RequestLimits
from diffserve.engine.cost_model import StepCostModel
from diffserve.engine.queues import PREEMPT_HEADROOM, RequestQueues
from diffserve.engine.request import Phase, Request

SPEC = ModelSpec(resolution_factor=2, default_height=8, default_width=8, default_num_inference_steps=4,
                 default_guidance_scale=1.0)


def _request(seq: int, rows: int = 2, priority: int = 0, deadline_s: float | None = None, steps: int = 10,
             age_s: float = 0.0) -> Request:
    params = SamplingParams(priority=priority, deadline_s=deadline_s)
    return Request(request_id=f"r{seq}", prompt="p", params=params, batch_key="k", rows=rows, seq=seq,
                   arrival_time=time.perf_counter() - age_s, num_steps=steps, tokens=16 * rows)


def _admit_and_denoise(queues: RequestQueues) -> list[Request]:
    admitted = queues.admit()
    for r in admitted:
        r.phase = Phase.DENOISING
    queues.changed()
    return admitted


# ------------------------------------------------------------------ request validation
@pytest.mark.parametrize("field,value", [("priority", "high"), ("priority", 1.5), ("priority", True),
                                         ("priority", 2**31), ("deadline_s", 0), ("deadline_s", -1.0),
                                         ("deadline_s", math.inf), ("deadline_s", math.nan),
                                         ("deadline_s", "5")])
def test_bad_priority_or_deadline_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).resolve(SPEC, RequestLimits())
    assert info.value.field == field


@pytest.mark.parametrize("field", ["deadline_s", "guidance_scale", "eta"])
@pytest.mark.parametrize("value", [10**400, -10**400], ids=["1e400", "-1e400"])
def test_an_integer_too_large_for_a_float_is_refused_naming_the_field(field, value):
    """float(10**400) raises OverflowError: it must be the field's InvalidRequestError instead."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).resolve(SPEC, RequestLimits())
    assert info.value.field == field


def test_deadline_under_fcfs_is_accepted():
    p = SamplingParams(priority=-3, deadline_s=2).resolve(SPEC, RequestLimits())
    assert p.priority == -3 and p.deadline_s == 2.0


# ------------------------------------------------------------------ queue rules (no model)
def test_fcfs_never_preempts():
    queues = RequestQueues(4, 100)
    for k in range(2):
        queues.add(_request(k, priority=5))
    _admit_and_denoise(queues)
    queues.add(_request(2, priority=-1))
    assert _admit_and_denoise(queues) == []  # the rows are taken: it waits its turn
    assert [r.seq for r in queues.select_batch()] == [0, 1]


def test_priority_admits_past_a_full_batch_and_preempts_the_worst():
    queues = RequestQueues(4, 100, policy="priority")
    for k in range(2):
        queues.add(_request(k, priority=5))
    _admit_and_denoise(queues)
    assert [r.seq for r in queues.select_batch()] == [0, 1]
    queues.add(_request(2, priority=-1))
    assert [r.seq for r in _admit_and_denoise(queues)] == [2]
    assert [r.seq for r in queues.select_batch()] == [2, 0]  # request 1 preempted at the boundary
    assert queues.preemptions == 1 and queues.running[1].metrics.preemptions == 1
    queues.add(_request(3, priority=-1))
    queues.add(_request(4, priority=9))
    admitted = _admit_and_denoise(queues)  # headroom: at most PREEMPT_HEADROOM x rows held
    assert queues.running_rows <= PREEMPT_HEADROOM * 4 and [r.seq for r in admitted] == [3]


def test_aging_bounds_the_wait():
    """A request older than aging_s ranks before every younger one, whatever its priority."""
    queues = RequestQueues(2, 100, policy="priority", aging_s=5.0)
    queues.add(_request(0, priority=9, age_s=6.0))  # waited past the bound
    queues.add(_request(1, priority=-9))
    assert [r.seq for r in _admit_and_denoise(queues)] == [0]


def test_slo_runs_least_slack_first():
    model = StepCostModel()
    for _ in range(5):
        model.observe(32, 0.1)  # 0.1 s a step
    queues = RequestQueues(2, 100, policy="slo", cost_model=model)
    queues.add(_request(0, deadline_s=100.0, steps=10))  # slack ~99 s
    queues.add(_request(1, deadline_s=3.0, steps=20))    # slack ~1 s: first
    queues.add(_request(2, steps=1))                     # no deadline: after those with one
    _admit_and_denoise(queues)
    assert [r.seq for r in queues.select_batch()] == [1]


def test_slo_counts_a_streams_chunks_still_to_come():
    """A stream's ``deadline_s`` covers all its chunks: its slack counts every chunk's steps, not
    only the current chunk's (`Request.remaining_steps`)."""
    queues = RequestQueues(8, 100, policy="slo")
    stream = _request(0, deadline_s=1.2, steps=10)
    stream.params = SamplingParams(deadline_s=1.2, num_chunks=4)
    plain = _request(1, deadline_s=1.0, steps=10)
    assert (stream.remaining_steps, plain.remaining_steps) == (40, 10)
    stream.chunk_index, stream.steps_done = 2, 3
    assert stream.remaining_steps == 7 + 10
    stream.chunk_index, stream.steps_done = 0, 0
    now = time.perf_counter()
    # slack: stream 1.2 - 40 x 0.01 = 0.8 < plain 1.0 - 10 x 0.01 = 0.9 (one chunk only: 1.1)
    assert queues.rank(stream, now, 0.01) < queues.rank(plain, now, 0.01)


def test_admission_slo_counts_every_chunk_of_a_stream(one_torch_thread):
    from diffserve.models.digits_video import DEFAULT_MODEL_PATH

    engine = DiffusionEngine(EngineConfig(model=str(DEFAULT_MODEL_PATH), admission="slo", num_threads=1))
    try:
        engine.generate(["a handwritten digit 1 moving left"], [SamplingParams(num_inference_steps=4, seed=1)])
        one_chunk = SamplingParams(num_inference_steps=20, num_chunks=1, deadline_s=60.0, seed=2)
        engine.add_request("a handwritten digit 2 moving left", one_chunk, request_id="one")
        engine.abort("one")
        # 1000 chunks x 20 steps: far beyond 60 s at any CPU's step time, one chunk far within it
        with pytest.raises(DeadlineUnmeetableError, match="20000 steps"):
            engine.add_request("a handwritten digit 3 moving left",
                               SamplingParams(num_inference_steps=20, num_chunks=1000, deadline_s=60.0, seed=3))
    finally:
        engine.shutdown()


def test_cost_model_fits_a_line():
    model = StepCostModel(decay=1.0)
    assert model.predict(10) is None
    for tokens in (10, 20, 40, 80):
        model.observe(tokens, 0.01 + 0.001 * tokens)
    a, b = model.coefficients()
    assert a == pytest.approx(0.01, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)
    assert model.predict(100) == pytest.approx(0.11, rel=1e-6)



def test_cost_model_follows_a_concave_cost_where_it_has_seen_steps():
    """A step cost that grows slower than linearly (per-token cost falling with the batch, as on
    a CPU): the line overpredicts the large steps and underpredicts the small ones; `predict`
    interpolates between the observed buckets' mean points instead, and continues with the
    line's slope outside them."""
    def cost(tokens):
        return 0.002 + 0.0005 * tokens ** 0.5

    model = StepCostModel(decay=1.0)
    for _ in range(3):
        for tokens in (32, 64, 128, 256):
            model.observe(tokens, cost(tokens))
    a, b = model.coefficients()
    assert a + b * 32 != pytest.approx(cost(32), rel=0.05)  # the line misses the small steps...
    for tokens in (32, 64, 128, 256):
        assert model.predict(tokens) == pytest.approx(cost(tokens), rel=1e-9)  # ...the points do not
    assert cost(96) * 0.97 < model.predict(96) < cost(96)  # a chord under a concave curve
    assert model.predict(512) == pytest.approx(cost(256) + b * 256)
    assert model.predict(16) == pytest.approx(max(cost(32) - b * 16, cost(32) / 2))
    for _ in range(5):  # noisy fast steps: 128's bucket mean drops below 64's
        model.observe(128, cost(32) / 2)
    assert model.predict(128) == pytest.approx(model.predict(64)) and model.predict(96) >= model.predict(64)


# ------------------------------------------------------------------ the engine (built-in model)
def _run_behind_full_batch(policy: str):
    """Two long low-priority requests fill the batch (4 rows); an urgent short one arrives.
    Returns (finish order as "hi"/"lo", outputs by id, the urgent request's id, stats)."""
    engine = DiffusionEngine(EngineConfig(model="digits", max_batch_size=4, scheduling_policy=policy,
                                          num_threads=1))
    try:
        low_params = [SamplingParams(num_inference_steps=24, seed=k, guidance_scale=3.0, priority=5,
                                     output_type="np") for k in range(2)]
        for k, p in enumerate(low_params):
            engine.add_request(f"the digit {k}", p, request_id=f"lo{k}")
        order, outs = [], {}
        for _ in range(4):
            engine.step()
        engine.add_request("the digit 9", SamplingParams(num_inference_steps=3, seed=9, guidance_scale=3.0,
                                                         priority=-1, deadline_s=60.0, output_type="np"),
                           request_id="hi")
        while engine.has_unfinished_requests():
            for event in engine.step():
                if event.type.value == "finished":
                    order.append(event.request_id)
                    outs[event.request_id] = event.output
        solo = {f"lo{k}": engine.generate([f"the digit {k}"], [p])[0] for k, p in enumerate(low_params)}
        return order, outs, solo, engine.stats()["scheduler"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["priority", "slo"])
def test_urgent_request_behind_a_full_batch_finishes_first(policy, one_torch_thread):
    order, outs, solo, stats = _run_behind_full_batch(policy)
    assert order[0] == "hi", order
    assert stats["preemptions"] >= 1 and stats["scheduling_policy"] == policy
    preempted = [k for k in ("lo0", "lo1") if outs[k].metrics.preemptions]
    assert preempted, "no low-priority request was preempted"
    for k in ("lo0", "lo1"):  # preempted and resumed = never preempted (its solo run)
        diff = float(np.abs(outs[k].images - solo[k].images).max())
        assert diff <= 1e-4, f"{k} (preempted {outs[k].metrics.preemptions}x) differs from its solo run by {diff}"
    assert stats["slo_attainment"] == 1.0 and stats["queue_delay_s"]["-1"]["requests"] == 1
    assert stats["mean_rows_per_forward"] > 0 and stats["mean_tokens_per_forward"] > 0


def test_fcfs_keeps_arrival_order(one_torch_thread):
    order, _, _, stats = _run_behind_full_batch("fcfs")
    assert order[-1] == "hi" and stats["preemptions"] == 0


def test_admission_slo_refuses_an_unmeetable_deadline(one_torch_thread):
    engine = DiffusionEngine(EngineConfig(model="digits", admission="slo", num_threads=1))
    try:
        engine.generate(["the digit 1"], [SamplingParams(num_inference_steps=3, seed=1)])  # the model learns
        with pytest.raises(DeadlineUnmeetableError, match="deadline_s"):
            engine.add_request("the digit 2", SamplingParams(num_inference_steps=200, deadline_s=1e-6))
        [out] = engine.generate(["the digit 3"], [SamplingParams(num_inference_steps=2, deadline_s=600.0)])
        assert out.ok and out.metrics.deadline_met is True
        assert engine.stats()["scheduler"]["refused_deadline"] == 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_admission_slo_counts_only_the_work_ranked_ahead(policy, one_torch_thread):
    """An urgent request behind a full batch of long low-priority ones: under ``slo`` it preempts
    them (it runs at once), so ``--admission slo`` must not count their remaining steps against
    its deadline; under ``fcfs`` it does wait for them, and is refused."""
    engine = DiffusionEngine(EngineConfig(model="digits", max_batch_size=4, scheduling_policy=policy,
                                          admission="slo", num_threads=1, max_num_inference_steps=5000))
    try:
        for k in range(4):  # 2 running (2 rows each), 2 waiting: ~2000 batch steps of work
            engine.add_request(f"the digit {k}", SamplingParams(num_inference_steps=2000, seed=k, priority=5),
                               request_id=f"lo{k}")
        for _ in range(4):
            engine.step()  # the cost model learns a step's cost
        urgent = SamplingParams(num_inference_steps=3, seed=9, priority=-1, deadline_s=10.0, output_type="np")
        if policy == "fcfs":
            with pytest.raises(DeadlineUnmeetableError, match="work ahead"):
                engine.add_request("the digit 9", urgent, request_id="hi")
            return
        engine.add_request("the digit 9", urgent, request_id="hi")
        finished = None
        while finished is None:
            finished = next((e for e in engine.step() if e.type.value == "finished"), None)
        assert finished.request_id == "hi" and finished.output.metrics.deadline_met is True
        assert engine.stats()["scheduler"]["refused_deadline"] == 0
    finally:
        engine.shutdown()


def test_queue_delay_counts_a_bounded_number_of_priorities():
    """Clients choose ``priority`` (any 32-bit integer), and each counted priority is a series
    in ``/metrics``: past `MAX_PRIORITY_BUCKETS` distinct ones, the rest share ``"other"``."""
    from diffserve.engine.scheduler_stats import MAX_PRIORITY_BUCKETS, SchedulerCounters

    counters = SchedulerCounters()
    for p in range(-5, 5000):
        counters.queued(p, 0.5)
    counters.queued(-5, 1.5)
    delay = counters.as_dict()["queue_delay_s"]
    assert len(delay) == MAX_PRIORITY_BUCKETS + 1
    assert list(delay)[:2] == ["-5", "-4"] and list(delay)[-1] == "other"
    assert delay["-5"] == {"requests": 2, "mean": 1.0, "max": 1.5}
    assert delay["other"]["requests"] == 5005 - MAX_PRIORITY_BUCKETS


# ------------------------------------------------------------------ the padding cap (max_padding_ratio)
@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, "0.5", True, None])
def test_bad_max_padding_ratio_is_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(max_padding_ratio=value)
    assert info.value.field == "max_padding_ratio" and "[0, 1]" in str(info.value)


@pytest.mark.parametrize("flag,fragment", [
    ("1.5", "argument --max-padding-ratio: invalid value 1.5: must be a number in [0, 1]"),
    ("-0.25", "argument --max-padding-ratio: invalid value -0.25"),
    ("nan", "argument --max-padding-ratio: invalid value nan"),
    ("half", "argument --max-padding-ratio: invalid value 'half': a number in [0, 1] or 'auto'"),
])
def test_bad_max_padding_ratio_flag_names_the_flag(tmp_path, capsys, flag, fragment):
    from diffserve.entrypoints.cli import main

    try:
        rc = main(["generate", "a digit 3", "-o", str(tmp_path / "out"), "--max-padding-ratio", flag])
    except SystemExit as exc:  # argparse's own (types)
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_max_padding_ratio_flag_takes_auto():
    import argparse

    from diffserve.entrypoints.engine_args import add_engine_arguments, check_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for flag, value in (("auto", "auto"), ("0.25", 0.25)):
        args = parser.parse_args(["--max-padding-ratio", flag])
        check_engine_arguments(args)
        assert args.max_padding_ratio == value


@pytest.mark.parametrize("ratio", [0.0, 1.0, "auto"])
def test_padding_cap_on_the_built_in_model(ratio, one_torch_thread):
    """Mixed sizes on the digits model: under R = 0 no forward pads a row (each size steps in its
    own forwards), under R = 1 they share forwards with padding; every output equals its solo
    run either way."""
    engine = DiffusionEngine(EngineConfig(model="digits", max_batch_size=8, num_threads=1,
                                          max_padding_ratio=ratio))
    try:
        sizes = [(8, 8), (4, 8), (8, 4), (8, 8), (4, 4), (4, 8)]
        params = [SamplingParams(num_inference_steps=3, seed=k, height=h, width=w, output_type="np")
                  for k, (h, w) in enumerate(sizes)]
        outs = engine.generate([f"the digit {k}" for k in range(len(sizes))], params)
        stats = engine.stats()["scheduler"]
        solo = [engine.generate([f"the digit {k}"], [p])[0] for k, p in enumerate(params)]
    finally:
        engine.shutdown()
    if ratio == 0.0:
        assert stats["padded_token_share"] == 0.0
    elif ratio == 1.0:
        assert stats["padded_token_share"] > 0.0
    else:  # auto: the cost model was fitted on this run's forwards (over token slots)
        assert stats["cost_model"]["steps"] == stats["forwards"]
    for out, alone in zip(outs, solo):
        assert out.ok and float(np.abs(out.images - alone.images).max()) <= 1e-4


# ------------------------------------------------------------------ slo: deadline-aware batch size
def _fitted(a: float = 0.001, b: float = 4e-5) -> StepCostModel:
    """A cost model that has seen two loads exactly on step seconds = a + b x token slots."""
    model = StepCostModel()
    for slots in (32, 256):
        model.observe(slots, a + b * slots)
    return model


def _urgent_wide_behind_small_long_ones(policy: str, model: StepCostModel | None,
                                        padding_free: bool = False) -> RequestQueues:
    """Seven long 16-token-row requests (deadline 10 s), then an urgent 64-token-row one: 4 steps,
    80 ms. Compute-bound costs (a = 1 ms, b = 40 us): a full 16-row forward pads every row to
    64 tokens (1024 slots, 42 ms a step: 168 ms for its 4 steps, a miss); alone 6.1 ms a step
    (25 ms); at the load's tokens (352: 15 ms a step, 60 ms) it is not hopeless, so it leads."""
    now = 100.0
    queues = RequestQueues(16, 100, policy=policy, cost_model=model, clock=lambda: now, padding_free=padding_free)
    for k in range(7):
        queues.add(Request(request_id=f"long{k}", prompt="p", params=SamplingParams(deadline_s=10.0),
                           batch_key=None, rows=2, seq=k, arrival_time=now, num_steps=8, tokens=32))
    queues.add(Request(request_id="urgent", prompt="p", params=SamplingParams(deadline_s=0.08), batch_key=None,
                       rows=2, seq=7, arrival_time=now, num_steps=4, tokens=128))
    _admit_and_denoise(queues)
    return queues


def test_slo_runs_an_urgent_request_in_a_smaller_batch_that_meets_its_deadline():
    a, b = 0.001, 4e-5
    queues = _urgent_wide_behind_small_long_ones("slo", _fitted(a, b))
    batch = queues.select_batch()
    # prefixes of the least-slack order: 1, 2, 3 requests meet the urgent deadline (4 steps at
    # 6.1, 11.2, 16.4 ms), 4 do not (21.5 ms): every deadline is met up to 3, ties go larger
    assert [r.request_id for r in batch] == ["urgent", "long0", "long1"]
    assert 4 * (a + b * queues.batch_slots) <= 0.08 < 4 * (a + b * 16 * 64)
    assert queues.preemptions == 0


def test_slo_prefix_counts_real_tokens_on_a_padding_free_model():
    """Where mixed-size forwards compute real tokens only (length groups), the deadline-aware
    batch size predicts each prefix at its real tokens, as the cost model was fitted: the whole
    batch (352 tokens: 15.1 ms a step, 60 ms for the urgent request's 4 steps) meets every
    deadline, so nobody is left out for the padding a padded forward would have cost."""
    queues = _urgent_wide_behind_small_long_ones("slo", _fitted(0.001, 4e-5), padding_free=True)
    assert len(queues.select_batch()) == 8 and queues.preemptions == 0


@pytest.mark.parametrize("policy,model", [("fcfs", "fitted"), ("slo", None)], ids=["fcfs", "slo-unfitted"])
def test_full_batch_under_fcfs_and_before_the_cost_model_is_fitted(policy, model):
    queues = _urgent_wide_behind_small_long_ones(policy, _fitted() if model else None)
    batch = queues.select_batch()
    assert len(batch) == 8 and queues.batch_slots == 16 * 64


def test_slo_keeps_the_running_members_unless_it_costs_a_deadline():
    """Hysteresis: with every deadline loose, the full batch runs and stays, step after step."""
    now = [0.0]
    queues = RequestQueues(8, 100, policy="slo", cost_model=_fitted(), clock=lambda: now[0])
    for k in range(4):
        queues.add(Request(request_id=f"r{k}", prompt="p", params=SamplingParams(deadline_s=5.0 + k),
                           batch_key=None, rows=2, seq=k, arrival_time=0.0, num_steps=8, tokens=32))
    _admit_and_denoise(queues)
    for _ in range(8):
        batch = queues.select_batch()
        assert len(batch) == 4
        for r in batch:
            r.steps_done += 1
        now[0] += 0.01
        queues.changed()
    assert queues.preemptions == 0
