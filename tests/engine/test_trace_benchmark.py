"""`benchmarks/serving.py`'s trace mode on the built-in model (issue 27): with
`--capacity-per-repeat`, each repeat's open-loop rates AND deadlines follow the speed the host
runs at in that repeat, so a host that slows down does not tighten the later repeats' deadlines.

The replays run the real engine (tiny traces, 2 steps); only the solo-latency probe is replaced,
by one whose host "slows down" by a known factor per call."""

from __future__ import annotations

import argparse

import pytest

import serving  # benchmarks/serving.py (tests/conftest.py puts benchmarks/ on sys.path)
from diffserve import EngineConfig


@pytest.fixture(scope="module")
def runner():
    config = EngineConfig(model=None, max_batch_size=16, max_waiting_requests=1000, num_threads=1)
    return config, serving.load_runner(config)[2]


def _args(**overrides) -> argparse.Namespace:
    args = argparse.Namespace(trace="builtin", num_requests=6, steps=2, seed=0, size=None, slo_tight=3.0,
                              slo_loose=12.0, concurrency=4, slo_scales="", guidance=None, trace_loads="1.0",
                              padding_ratios="", trace_arms="per_size,mixed", aging_s=60.0,
                              capacity_per_repeat=True, repeats=2)
    vars(args).update(overrides)
    return args


def _open_loop_replays(monkeypatch) -> list[list[serving.TraceJob]]:
    """Record the jobs of every open-loop replay (concurrency None) the benchmark runs."""
    seen, real = [], serving.replay

    def spy(engine, jobs, concurrency, *args, **kwargs):
        if concurrency is None:
            seen.append(list(jobs))
        return real(engine, jobs, concurrency, *args, **kwargs)

    monkeypatch.setattr(serving, "replay", spy)
    return seen


def test_solo_scale_deadlines_are_measured_again_each_repeat(runner, monkeypatch):
    config, model_runner = runner
    calls = []

    def slowing_solo(engine_for, jobs, guidance, seed, rounds=5):  # call k: the host is k x slower
        calls.append(None)
        return {(j.height, j.width, j.steps): 0.01 * len(calls) for j in jobs}

    monkeypatch.setattr(serving, "solo_latencies", slowing_solo)
    seen = _open_loop_replays(monkeypatch)
    result = serving.run_trace(_args(slo_scales="2"), config, model_runner)
    assert len(calls) == 3  # before the repeats, then once per repeat
    assert result["deadline_factor_by_repeat"] == pytest.approx([2.0, 3.0])
    assert len(seen) == 4  # 2 arms x 2 repeats
    for replayed, solo in zip(seen, (0.02, 0.02, 0.03, 0.03)):
        assert [j.deadline_s for j in replayed] == pytest.approx([2 * solo] * len(replayed))
        assert [j.solo_s for j in replayed] == pytest.approx([solo] * len(replayed))


def test_step_based_classes_follow_each_repeats_capacity(runner, monkeypatch):
    config, model_runner = runner
    seen = _open_loop_replays(monkeypatch)
    result = serving.run_trace(_args(), config, model_runner)
    capacities = result["capacity_by_repeat"]
    assert len(capacities) == 2 and all(c > 0 for c in capacities)
    first, later = seen[0], seen[-1]  # repeat 0's first arm, repeat 1's last
    assert [j.deadline_s is not None for j in first] == [True] * len(first)
    # deadline = class factor x steps x a full-batch step, and that step is 1 / capacity
    for a, b in zip(first, later):
        assert a.deadline_s * capacities[0] == pytest.approx(b.deadline_s * capacities[1])
    assert result["deadline_factor_by_repeat"] == pytest.approx(
        [result["capacity_req_per_s"] / c for c in capacities])  # a full-batch step over the probe's


def test_without_the_flag_deadlines_stay_those_of_the_first_measure(runner, monkeypatch):
    config, model_runner = runner
    seen = _open_loop_replays(monkeypatch)
    result = serving.run_trace(_args(capacity_per_repeat=False), config, model_runner)
    assert result["deadline_factor_by_repeat"] == []
    assert [j.deadline_s for j in seen[0]] == [j.deadline_s for j in seen[-1]]
