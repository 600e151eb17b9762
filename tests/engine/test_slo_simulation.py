"""`benchmarks/slo_simulation.py`: the real `RequestQueues` on a virtual clock (issue 27).

Fixed cost model, no model weights: the simulation is deterministic, and the scheduling
policies order requests in virtual time as they do on the engine's wall clock."""

from __future__ import annotations

import argparse

import pytest

import slo_simulation as sim  # benchmarks/slo_simulation.py (tests/conftest.py puts benchmarks/ on sys.path)
import serving  # benchmarks/serving.py
from serving import TraceJob

COST = (0.004, 7.4e-5)


def _args(**overrides):
    args = argparse.Namespace(arms=["per_size", "mixed", "mixed_priority", "mixed_slo", "mixed_slo_adm"],
                              loads=[1.0], scales=[2.0, 5.0], seeds=2, seed=0, num_requests=32, steps=8,
                              max_batch_size=16, concurrency=8, aging_s=60.0, capacity_arm="per_size",
                              padding_free=False)
    vars(args).update(overrides)
    return args


def test_sweep_is_deterministic():
    first, second = sim.sweep(_args(), COST), sim.sweep(_args(), COST)
    assert first == second
    assert len(first) == 2 * 2 * 5  # seeds x scales x arms
    # the capacity run makes "100% load" a load the per-size arm cannot always keep up with
    per_size = [r["attainment"] for r in first if r["arm"] == "per_size" and r["scale"] == 2.0]
    assert min(per_size) < 1.0


def _urgent_behind_long_ones() -> list[TraceJob]:
    """Four long low-priority requests fill a 4-row batch twice over; a short high-priority one
    arrives right after them."""
    jobs = [TraceJob(0.0, f"long {i}", 8, 8, 20, priority=1, deadline_s=100.0) for i in range(4)]
    return jobs + [TraceJob(0.001, "urgent", 8, 8, 4, priority=0, deadline_s=0.2)]


def test_priority_finishes_the_urgent_request_first():
    for arm, first in (("mixed_priority", True), ("mixed_slo", True), ("mixed", False)):
        outcomes, queues = sim.simulate(_urgent_behind_long_ones(), sim.parse_arm(arm), COST, max_batch_size=4)
        urgent, long_ones = outcomes[-1], outcomes[:-1]
        assert all(o.finish is not None for o in outcomes)
        assert (urgent.finish < min(o.finish for o in long_ones)) is first, arm
        if first:
            assert queues.preemptions >= 1  # it displaced a running long request at a step boundary


def test_parse_arm_rejects_unknown_names():
    assert sim.parse_arm("mixed_slo_adm_pad0.25") == sim.Arm(True, "slo", "slo", 0.25)
    assert sim.parse_arm("per_size_padauto").max_padding_ratio == "auto"
    with pytest.raises(ValueError, match="mixed_edf"):
        sim.parse_arm("mixed_edf")


def test_slo_runs_a_smaller_batch_for_an_urgent_request_on_a_compute_bound_device():
    """Compute-bound (a = 1 ms, b = 40 us): the urgent 16x16 request arriving beside seven long
    8x8 ones misses its deadline in the full padded batch (FCFS: 4 steps of 1024 slots, 168 ms),
    and meets it under ``slo``, which runs it in a smaller, faster batch once the cost model has
    seen the first (full) step; the long ones still meet theirs."""
    cost = (0.001, 4e-5)
    jobs = [TraceJob(0.0, f"long {i}", 8, 8, 8, priority=1, deadline_s=10.0) for i in range(7)]
    jobs.append(TraceJob(0.0, "urgent", 16, 16, 4, priority=0, deadline_s=0.12))
    met = {}
    for arm in ("mixed", "mixed_slo"):
        outcomes, _ = sim.simulate(jobs, sim.parse_arm(arm), cost, max_batch_size=16)
        met[arm] = [o.latency <= o.job.deadline_s for o in outcomes]
    assert met["mixed"] == [True] * 7 + [False]
    assert met["mixed_slo"] == [True] * 8


def test_padding_free_steps_cost_their_real_tokens():
    """``padding_free`` (length groups): a mixed step of a 16x16 and a 8x8 request costs its real
    tokens (2 x (64 + 16) with CFG rows), not its slots (4 x 64), so both finish sooner than
    padded; per-size batching has no padding, so it is unchanged."""
    jobs = [TraceJob(0.0, "big", 16, 16, 4), TraceJob(0.0, "small", 8, 8, 4)]
    finish = {}
    for arm in ("mixed", "per_size"):
        for free in (False, True):
            outcomes, _ = sim.simulate(jobs, sim.parse_arm(arm), COST, padding_free=free)
            finish[arm, free] = max(o.finish for o in outcomes)
    a, b = COST
    assert finish["mixed", False] == pytest.approx(4 * (a + b * 4 * 64))
    assert finish["mixed", True] == pytest.approx(4 * (a + b * 2 * (64 + 16)))
    assert finish["per_size", True] == finish["per_size", False]


@pytest.mark.parametrize("flag, value", [("--arms", "mixed_edf"), ("--capacity-arm", "bogus"), ("--loads", "x"),
                                         ("--loads", "0"), ("--loads", "-1"), ("--scales", "0"), ("--scales", "nan"),
                                         ("--seeds", "0"), ("--num-requests", "0"), ("--steps", "0"),
                                         ("--max-batch-size", "0"), ("--concurrency", "0"), ("--aging-s", "0"),
                                         ("--measure-requests", "0"), ("--cost", "1"), ("--cost", "nan,1")])
def test_bad_flag_values_are_usage_errors_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sim.parse_args([f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_parse_args_reads_the_lists():
    args = sim.parse_args(["--arms", "mixed, mixed_slo_padauto", "--loads", "0.8,1.2", "--scales", "2", "--cost",
                           "0.001,4e-5"])
    assert args.arms == ["mixed", "mixed_slo_padauto"] and args.loads == [0.8, 1.2] and args.scales == [2.0]
    assert args.cost == (0.001, 4e-5)


def _trace_args(**overrides):
    args = argparse.Namespace(trace_loads="0.8,1.0", slo_scales="", padding_ratios="",
                              trace_arms="per_size,mixed,mixed_slo")
    vars(args).update(overrides)
    return args


@pytest.mark.parametrize("flag, value", [("--trace-loads", "x"), ("--trace-loads", "0"), ("--slo-scales", "0"),
                                         ("--slo-scales", "inf"), ("--padding-ratios", "2"),
                                         ("--padding-ratios", "x"), ("--trace-arms", "bogus"),
                                         ("--trace-arms", "mixed_pad1.5")])
def test_serving_trace_flags_are_usage_errors_naming_the_flag(flag, value, capsys):
    """benchmarks/serving.py's trace flags: a bad value exits 2 naming the flag (it raised
    ValueError / InvalidRequestError mid-run, or ignored an unknown arm without an open loop)."""
    parser = argparse.ArgumentParser(prog="serving.py")
    with pytest.raises(SystemExit) as exit_info:
        serving.check_trace_args(parser, _trace_args(**{flag[2:].replace("-", "_"): value}))
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_serving_trace_flags_accept_good_values():
    serving.check_trace_args(argparse.ArgumentParser(), _trace_args(
        trace_loads="", slo_scales="1.5,2", padding_ratios="0,0.25,auto",
        trace_arms="per_size,mixed_slo_adm,mixed_pad0.5,mixed_padauto"))
