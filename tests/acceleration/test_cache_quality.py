"""Quality levels of step caching (`SamplingParams.cache_quality`): TaylorSeer forecasts, the
run-time guard, per-request levels sharing step batches, and the refusals.

The strong check of per-request state: a request's output equals its solo run (within batching
tolerance) when requests of different levels share forwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.acceleration.cache_guard import GuardState
from diffserve.acceleration.cache_quality import DEFAULT_LEVELS, levels_with
from diffserve.acceleration.forecast import Forecaster

TOL = 1e-4
# The tiny random model's trajectory is rough: levels that skip on it at 12 steps.
LEVELS = {"high": {"interval": 2, "warmup_steps": 2, "budget": 1.0},
          "balanced": {"interval": 3, "warmup_steps": 2, "budget": 2.0},
          "fast": {"interval": 4, "warmup_steps": 2, "budget": None}}


def _engine(model_dir, compile=False, max_batch_size=16, **options) -> DiffusionEngine:
    return DiffusionEngine(EngineConfig(model=str(model_dir), cache_backend="teacache", overlap_stages=False,
                                        compile=compile, max_batch_size=max_batch_size,
                                        cache_config={"levels": LEVELS, **options}))


def _p(seed, steps=12, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, output_type="np", **kw)


def _run(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


# ----------------------------------------------------------------------- forecasting
def test_forecaster_is_exact_on_polynomials_over_uneven_timesteps():
    shape = (2, 3, 4)
    a, b, c = (torch.randn(shape, dtype=torch.float64) for _ in range(3))
    line = lambda t: a + b * t  # noqa: E731
    quad = lambda t: a + b * t + c * t * t  # noqa: E731
    nodes = [900.0, 850.0, 700.0, 620.0]  # uneven, like a shifted flow-matching schedule
    f1 = Forecaster.fit([(t, line(t)) for t in nodes], order=1)
    assert f1.order == 1 and torch.allclose(f1.predict(400.0), line(400.0))
    assert f1.remainder(400.0) == pytest.approx(0.0, abs=1e-12)  # no curvature: no remainder
    f2 = Forecaster.fit([(t, quad(t)) for t in nodes], order=2)
    assert torch.allclose(f2.predict(300.0), quad(300.0))
    # order 1 on a parabola: the remainder is the exact error of the linear forecast
    f1q = Forecaster.fit([(t, quad(t)) for t in nodes[1:]], order=1)
    error = float((f1q.predict(300.0) - quad(300.0)).abs().mean())
    assert f1q.remainder(300.0) == pytest.approx(error, rel=1e-9)
    reuse = Forecaster.fit([(nodes[0], a)], order=2)  # one point: reuse, no remainder
    assert reuse.order == 0 and torch.equal(reuse.predict(1.0), a) and reuse.remainder(1.0) is None


def test_guard_state_adds_weighted_errors_and_applies_the_measured_correction():
    g = GuardState()
    assert g.allows(0.1, 0.5, budget=0.06) and not g.allows(0.1, 0.5, budget=0.04)
    assert not g.allows(0.0, 0.5, budget=0.0)  # a zero budget never skips
    g = g.skipped(0.1, 0.5).skipped(0.1, 0.5)
    assert g.estimate == pytest.approx(0.1)
    g = g.computed(measured=0.4, predicted=0.1)  # the check found 4x the a-priori error
    assert g.correction == 4.0 and g.checks == 1 and g.estimate == pytest.approx(0.4)
    assert not g.allows(0.1, 0.5, budget=0.5)  # 0.4 + 4 * 0.05 > 0.5


def test_levels_are_ordered_and_overrides_are_checked():
    assert [DEFAULT_LEVELS[n].budget for n in ("max", "high", "balanced", "fast")] == sorted(
        DEFAULT_LEVELS[n].budget for n in ("max", "high", "balanced", "fast"))
    assert not DEFAULT_LEVELS["max"].skips
    levels = levels_with({"fast": {"budget": 0.5}}, {"fast": {"interval": 6, "budget": None}})
    assert levels["fast"].interval == 6 and levels["fast"].budget == float("inf")
    assert levels["fast"].interval_for(50) == 15 and levels["fast"].warmup_for(50) == 8
    fractional = levels_with({"fast": {"interval": 2.8}})["fast"]
    assert (fractional.interval_for(20), fractional.interval_for(50)) == (3, 7)
    for bad in ({"ultra": {}}, {"max": {"budget": 1}}, {"fast": {"speed": 1}}, {"fast": {"order": -1}},
                {"fast": {"target": "latents"}}, {"fast": {"interval": 0.5}}):
        with pytest.raises(InvalidRequestError, match="teacache.cache_quality"):
            levels_with(bad)



@pytest.mark.parametrize("override, field, allowed", [
    ({"fast": {"interval": float("inf")}}, "cache_config.levels.fast.interval", "finite"),
    ({"fast": {"budget": float("nan")}}, "cache_config.levels.fast.budget", "a number >= 0"),
    ({"fast": {"rel_l1_thresh": float("nan")}}, "cache_config.levels.fast.rel_l1_thresh", "a number >= 0"),
    ({"fast": {"warmup_steps": 1.5}}, "cache_config.levels.fast.warmup_steps", "an integer >= 1"),
    ({"fast": {"warmup_steps": 0}}, "cache_config.levels.fast.warmup_steps", "an integer >= 1"),
    ({"fast": {"order": 3}}, "cache_config.levels.fast.order", r"an integer in \[0, 2\]"),
    ({"fast": {"speed": 1}}, "cache_config.levels.fast", "a field among"),
    ({"ultra": {}}, "cache_config.levels.ultra", "high, balanced, fast"),
    ({"fast": 3}, "cache_config.levels.fast", "an object of fields"),
])
def test_level_override_errors_name_their_source_and_field(override, field, allowed):
    """Each bad override is refused when the levels are built (never later, mid-request: an
    infinite interval used to raise OverflowError in the first step), naming the source the
    user wrote it in and the allowed range."""
    with pytest.raises(InvalidRequestError, match=allowed) as info:
        levels_with(None, override, fields=("teacache.cache_quality", "cache_config.levels"))
    assert info.value.field == field
    assert levels_with({"fast": {"budget": float("inf"), "rel_l1_thresh": 0.3}})["fast"].budget == float("inf")

# ------------------------------------------------------------------- in the engine
def test_levels_share_step_batches_and_each_equals_its_solo_run(tiny_sd3_dir):
    engine = _engine(tiny_sd3_dir)
    backend = engine.runner.accelerator.backend
    forwards: list[list[bool]] = []
    denoise, decide = backend.denoise, backend._decide

    def recording_denoise(adapter, batch):
        forwards.append([])
        return denoise(adapter, batch)

    def recording_decide(st, modulated, layout):
        result = decide(st, modulated, layout)
        if result is not None:  # None: decided once the embedding ran
            forwards[-1].append(result.compute)
        return result

    backend.denoise, backend._decide = recording_denoise, recording_decide
    jobs = [("one", _p(11, cache_quality="fast")), ("two", _p(12, steps=9, cache_quality="max")),
            ("three", _p(13, steps=10, cache_quality="high")), ("four", _p(14, cache_quality="balanced"))]
    ids = [engine.add_request(*jobs[0])]
    for _ in range(3):  # the first request runs ahead: later steps share forwards with others
        engine.step()
    ids += [engine.add_request(*job) for job in jobs[1:]]
    outputs = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.type.is_final:
                outputs[event.request_id] = event.output
    assert any(any(d) and not all(d) for d in forwards), "no forward mixed computed and skipped requests"
    assert max(outputs[ids[0]].metrics.batch_sizes) == 8  # all four shared forwards
    solo = _engine(tiny_sd3_dir)
    for request_id, job in zip(ids, jobs):
        alone = _run(solo, *job)
        assert np.abs(outputs[request_id].images - alone.images).max() <= TOL
        m = outputs[request_id].metrics
        assert m.cache_skipped_steps == alone.metrics.cache_skipped_steps
        assert m.cache_quality == job[1].cache_quality and m.as_dict()["cache_quality"] == m.cache_quality
    skipped = {job[1].cache_quality: outputs[i].metrics.cache_skipped_steps for i, job in zip(ids, jobs)}
    assert skipped["max"] == 0 and outputs[ids[1]].metrics.cache_error_estimate == 0.0
    assert 0 < skipped["high"] and 0 < skipped["balanced"] <= skipped["fast"]


def test_guard_computes_steps_to_hold_the_budget(tiny_sd3_dir):
    unguarded = _run(_engine(tiny_sd3_dir), "a kite", _p(6, steps=16, cache_quality="fast")).metrics
    budget = unguarded.cache_error_estimate / 3
    guarded_engine = _engine(tiny_sd3_dir, levels={"fast": {**LEVELS["fast"], "budget": budget}})
    guarded = _run(guarded_engine, "a kite", _p(6, steps=16, cache_quality="fast")).metrics
    assert unguarded.cache_skipped_steps > guarded.cache_skipped_steps > 0
    # no skip takes the estimate past the budget; a later check step may still raise it (it
    # measures what the skips before it really cost), so the final estimate can end above
    assert guarded.cache_error_estimate < unguarded.cache_error_estimate
    assert guarded.cache_error_estimate <= 2 * budget
    assert guarded.cache_check_steps > 0  # computed steps measured the forecast's error
    exact = _run(guarded_engine, "a kite", _p(6, steps=16, cache_quality="max"))
    reference = _run(DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir))), "a kite", _p(6, steps=16))
    np.testing.assert_array_equal(exact.images, reference.images)  # max never skips


def test_engine_default_level_and_plain_teacache(tiny_sd3_dir):
    assert _run(_engine(tiny_sd3_dir, cache_quality="high"), "x", _p(1)).metrics.cache_quality == "high"
    assert _run(_engine(tiny_sd3_dir), "x", _p(1)).metrics.cache_quality == "balanced"
    plain = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend="teacache",
                                         cache_config={"rel_l1_thresh": 0.3}))
    assert _run(plain, "x", _p(1)).metrics.cache_quality == "custom"
    assert _run(plain, "x", _p(1, cache_quality="fast")).metrics.cache_quality == "fast"


@pytest.mark.parametrize("backend, options, quality, accepted", [
    ("none", {}, "max", True), ("none", {}, "fast", False),
    ("cache_dit", {"Fn_compute_blocks": 1}, "high", False),
])
def test_levels_are_refused_by_name_without_a_backend_that_has_them(tiny_sd3_dir, backend, options, quality,
                                                                    accepted):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend=backend, cache_config=options))
    if accepted:
        assert _run(engine, "x", _p(1, steps=2, cache_quality=quality)).metrics.cache_quality is None
    else:
        with pytest.raises(InvalidRequestError, match="cache_quality"):
            engine.add_request("x", _p(1, cache_quality=quality))


def test_bad_cache_quality_names_the_field(tiny_sd3_dir):
    with pytest.raises(InvalidRequestError, match="cache_quality.*max, high, balanced, fast"):
        _engine(tiny_sd3_dir).add_request("x", _p(1, cache_quality="ultra"))
    with pytest.raises(InvalidRequestError, match="cache_config.cache_quality"):
        EngineConfig(model=str(tiny_sd3_dir), cache_backend="teacache", cache_config={"cache_quality": "ultra"})


def test_levels_run_on_regionally_compiled_blocks_without_recompiles(tmp_path_factory):
    from tiny_models import build_tiny_sd3

    one_block = build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_1"), num_layers=1)
    compiled = _engine(one_block, compile=True, max_batch_size=6)
    eager = _engine(one_block)
    jobs = [("a", _p(1, steps=9, cache_quality="fast")), ("b", _p(2, steps=8, cache_quality="max")),
            ("c", _p(3, steps=10, cache_quality="high", guidance_scale=1.0))]
    outs = compiled.generate([j[0] for j in jobs], [j[1] for j in jobs])  # computing subsets: 1-5 rows
    for out, job in zip(outs, jobs):
        assert np.abs(out.images - _run(eager, *job).images).max() <= TOL
    assert sum(o.metrics.cache_skipped_steps for o in outs) > 0
    stats = compiled.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["recompiles_after_warmup"] == 0


# ------------------------------------------------------------- magnitude (MagCache) forecasts
def test_magnitude_ratio_interpolates_the_log_norm_curve():
    from diffserve.acceleration.teacache import magnitude_ratio

    curve = (0.0, 1.0, 3.0)  # log norms at the start, middle and end of a schedule
    assert magnitude_ratio(curve, 2, 0, 3) == pytest.approx(np.exp(3.0))
    assert magnitude_ratio(curve, 1, 0, 5) == pytest.approx(np.exp(0.5))  # a quarter in: half of the first leg
    # ratios over a span telescope alike for any step count
    assert magnitude_ratio(curve, 4, 2, 5) == pytest.approx(magnitude_ratio(curve, 8, 4, 9))
    assert magnitude_ratio((1.0,), 3, 1, 5) == 1.0


def test_magnitude_levels_share_batches_with_taylor_levels_and_equal_their_solo_runs(tiny_sd3_dir, tmp_path):
    import json
    import shutil

    from diffserve.entrypoints.cli import main

    folder = tmp_path / "sd3"
    shutil.copytree(tiny_sd3_dir, folder)
    # without a calibrated curve a magnitude level is refused by name
    magnitude = {"forecast": "magnitude", "target": "residual", "order": 0, "interval": 3, "warmup_steps": 2,
                 "budget": None}
    with pytest.raises(InvalidRequestError, match=r"cache_config\.levels\.high\.forecast"):  # as the user set it
        _engine(folder, levels={**LEVELS, "high": magnitude})
    with pytest.raises(InvalidRequestError, match="teacache.cache_quality.high.forecast"):
        levels_with({"high": {"forecast": "magnitude"}})  # the output target cannot be scaled
    assert main(["calibrate-cache", "--model", str(folder), "--num-prompts", "2", "--seeds", "1", "--steps", "12",
                 "--budgets", "1.0", "--degree", "2", "--threads", "1"]) == 0
    curve = json.loads((folder / "diffserve_cache.json").read_text())["teacache"]["residual_log_norms"]
    assert len(curve) == 12 and all(np.isfinite(curve))
    levels = {**LEVELS, "high": magnitude}
    engine = _engine(folder, levels=levels)
    jobs = [("one", _p(21, cache_quality="high")), ("two", _p(22, steps=10, cache_quality="fast")),
            ("three", _p(23, steps=14, cache_quality="high"))]
    together = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert max(together[0].metrics.batch_sizes) == 6  # the three shared forwards
    solo = _engine(folder, levels=levels)
    reuse = _engine(folder, levels={**LEVELS, "high": {**magnitude, "forecast": "taylor"}})  # order 0: reuse
    for out, job in zip(together, jobs):
        alone = _run(solo, *job)
        assert np.abs(out.images - alone.images).max() <= TOL
        assert out.metrics.cache_skipped_steps == alone.metrics.cache_skipped_steps > 0
    # the forecast scales the reused residual: same skipped steps as plain reuse, other pixels
    plain = _run(reuse, *jobs[0])
    assert plain.metrics.cache_skipped_steps == together[0].metrics.cache_skipped_steps
    assert np.abs(plain.images - together[0].images).max() > TOL
