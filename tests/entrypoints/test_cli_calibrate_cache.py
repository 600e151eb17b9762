"""``diffserve calibrate-cache`` (a folder's TeaCache coefficients and level budgets, written to
``diffserve_cache.json`` and used by the engine) and ``generate --cache-quality``."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig
from diffserve.entrypoints.calibrate_cache import (add_calibrate_arguments, check_arguments, choose_budget,
                                                  fit_coefficients)
from diffserve.entrypoints.cli import check_generate_arguments, main
from diffserve.entrypoints.cli_args import build_parser
from diffserve.models.model_index import CACHE_CALIBRATION
from diffserve.pipelines.teacache_coefficients import FLUX_DEV


def _backend(folder, **cache_config):
    engine = DiffusionEngine(EngineConfig(model=str(folder), cache_backend="teacache", cache_config=cache_config))
    try:
        return engine.runner.accelerator.backend
    finally:
        engine.shutdown()


def test_calibrating_a_folder_writes_the_file_the_engine_then_uses(tiny_sd3_dir, tmp_path, capsys):
    folder = tmp_path / "sd3"
    shutil.copytree(tiny_sd3_dir, folder)
    before = _backend(folder)
    assert before.coefficients == FLUX_DEV  # the family's table (no calibration yet)
    rc = main(["calibrate-cache", "--model", str(folder), "--num-prompts", "2", "--seeds", "2", "--steps", "6",
               "--budgets", "0.05", "1.0", "--degree", "2", "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    path = folder / CACHE_CALIBRATION
    assert capsys.readouterr().out.strip().endswith(str(path))
    written = json.loads(path.read_text())
    teacache, calibration = written["teacache"], written["calibration"]
    # 2 prompts x 2 seeds, one point per step after the first of each 6-step uncached run
    assert calibration["points"] == 2 * 2 * 5 and calibration["steps"] == [6]
    assert len(teacache["coefficients"]) == 3 and all(np.isfinite(teacache["coefficients"]))
    assert [c["budget"] for c in calibration["candidates"]] == [0.05, 1.0]
    for level in ("high", "balanced", "fast"):
        assert teacache["cache_quality"][level]["budget"] in (0.0, 0.05, 1.0)
        for candidate in calibration["candidates"]:
            assert 0.0 <= candidate[level]["6"]["skipped"] < 1.0
    after = _backend(folder)
    assert after.coefficients == tuple(teacache["coefficients"]) != FLUX_DEV
    assert after.source == teacache["source"]
    assert {name: after.levels[name].budget for name in ("high", "balanced", "fast")} == \
        {name: value["budget"] for name, value in teacache["cache_quality"].items()}
    # an engine's own cache_config still wins over the folder's calibration
    assert _backend(folder, coefficients=[1.0, 0.0]).coefficients == (1.0, 0.0)


def test_recorded_changes_are_the_relative_l1_steps_of_max_requests(tiny_sd3_dir):
    from diffserve import SamplingParams

    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend="teacache",
                                          cache_config={"record_changes": True}))
    try:
        engine.generate(["a", "b"], [SamplingParams(seed=1, num_inference_steps=5, cache_quality="max"),
                                     SamplingParams(seed=2, num_inference_steps=4, cache_quality="fast")])
        changes = engine.stats()["acceleration"]["cache_backend"]["changes"]
    finally:
        engine.shutdown()
    assert len(changes) == 4  # the max request's steps 1..4; the fast one records nothing
    assert all(x > 0 and y > 0 for x, y in changes)


def test_fit_recovers_a_polynomial_and_budgets_follow_the_target():
    x = np.linspace(0.05, 0.5, 40)
    coefficients, rmse = fit_coefficients(x, 3 * x**2 - x + 0.2, 2)
    np.testing.assert_allclose(coefficients, [3, -1, 0.2], atol=1e-9)
    assert rmse < 1e-9
    # (budget, PSNR dB, skipped share): 0.3 misses 35 dB, so 0.4 is out even though it meets it
    candidates = [(0.4, 36.0, 0.7), (0.1, 41.0, 0.4), (0.2, 37.0, 0.5), (0.3, 34.0, 0.6)]
    assert choose_budget(candidates, 35.0) == 0.2
    assert choose_budget(candidates, 42.0) == 0.0  # even the smallest misses: never skip
    assert choose_budget([(0.1, 41.0, 0.4), (0.2, 40.5, 0.4)], 40.0) == 0.1  # no more skips: the tighter


@pytest.mark.parametrize("args, flag", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--seeds", "101"], "--seeds"),
    (["--steps", "1"], "--steps"),
    (["--budgets", "0.1", "-0.5"], "--budgets"),
    (["--budgets", "nan"], "--budgets"),
    (["--degree", "0"], "--degree"),
    (["--prompt", "  "], "--prompt"),
])
def test_bad_arguments_exit_2_naming_the_flag(args, flag, tmp_path, capsys):
    assert main(["calibrate-cache", "--output", str(tmp_path / "c.json"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"diffserve: error: argument {flag}:") and err.count("\n") == 1, err
    assert not (tmp_path / "c.json").exists()



def test_repeated_step_counts_run_once(tmp_path):
    """``--steps 20 12 20`` calibrates on 20 then 12 steps (the first count, which the magnitude
    curve is taken on, stays first), as repeated budgets collapse too."""
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    plan = check_arguments(parser.parse_args(["--output", str(tmp_path / "c.json"), "--steps", "20", "12", "20",
                                              "--budgets", "0.1", "0.05", "0.1"]))
    assert plan.steps == (20, 12) and plan.budgets == (0.05, 0.1)


@pytest.mark.parametrize("output", ["missing/c.json", "."])
def test_an_output_that_cannot_be_written_is_refused_before_any_compute(output, tmp_path, capsys):
    """A missing folder or a folder as --output was a FileNotFoundError / IsADirectoryError
    traceback after the whole calibration had run."""
    assert main(["calibrate-cache", "--output", str(tmp_path / output), "--num-prompts", "1", "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffserve: error: argument --output: invalid value") and err.count("\n") == 1, err
    assert "a file path in an existing folder" in err


def test_a_family_without_teacache_is_refused_by_name(tiny_sd15_dir, tmp_path, capsys):
    assert main(["calibrate-cache", "--model", str(tiny_sd15_dir), "--output", str(tmp_path / "c.json"),
                 "--steps", "3", "--num-prompts", "1", "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert "argument --model:" in err and "teacache" in err, err
    assert main(["calibrate-cache", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_cache_quality_flag_reaches_the_request(tiny_sd3_dir, tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["generate", "x", "--cache-quality", "fast", "-o", str(tmp_path)])
    assert check_generate_arguments(args, parser.commands["generate"]).params.cache_quality == "fast"
    args = parser.parse_args(["generate", "x", "-o", str(tmp_path)])
    assert check_generate_arguments(args, parser.commands["generate"]).params.cache_quality is None
    common = ["generate", "a cat", "--model", str(tiny_sd3_dir), "--steps", "6", "--seed", "3", "--threads", "1"]
    # without a cache backend only max is served: refused by flag, before any output
    assert main([*common, "--cache-quality", "high", "-o", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "argument --cache-quality: invalid value 'high'" in err and "teacache" in err, err
    with pytest.raises(SystemExit):  # not a level
        main([*common, "--cache-quality", "ultra"])
    assert "argument --cache-quality: invalid choice" in capsys.readouterr().err
    # the level reaches the engine: max never skips, fast skips (the stderr line per output)
    for level, out in (("max", "max"), ("fast", "fast")):
        assert main([*common, "--cache-backend", "teacache", "--cache-quality", level, "-o", str(tmp_path / out)]) == 0
    assert main([*common, "-o", str(tmp_path / "plain")]) == 0
    images = {name: np.asarray(Image.open(next((tmp_path / name).glob("*.png")))) for name in ("max", "fast", "plain")}
    plain = images["plain"]
    np.testing.assert_array_equal(images["max"], plain)  # max: every step computed, as without a cache
    assert not np.array_equal(images["fast"], plain)


def test_a_malformed_calibration_file_is_refused_naming_it(tmp_path):
    from diffserve.core.errors import UnsupportedModelError
    from diffserve.models.model_index import read_cache_calibration

    assert read_cache_calibration(tmp_path) == {} and read_cache_calibration(None) == {}
    for text, fragment in (("[1, 2]", "must hold a JSON object"), ('{"teacache": 3}', "'teacache' must be an object"),
                           ("{", "is not valid JSON")):
        (tmp_path / CACHE_CALIBRATION).write_text(text)
        with pytest.raises(UnsupportedModelError, match=fragment) as info:
            read_cache_calibration(tmp_path)
        assert CACHE_CALIBRATION in str(info.value)
