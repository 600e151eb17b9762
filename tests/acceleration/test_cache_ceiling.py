"""`benchmarks/cache_ceiling.py`: its reference loop follows the engine's own trajectories, so the
ceilings it reports (issue 31) are ceilings of the engine's step skipping on the built-in model."""

from __future__ import annotations

import numpy as np
import pytest

from cache_ceiling import ReferenceLoop  # benchmarks/ (tests/conftest.py puts it on sys.path)
from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.models import BUILTIN_PROMPTS

STEPS = 6


@pytest.fixture(scope="module")
def loop():
    return ReferenceLoop(images=3, steps=STEPS, guidance=4.0)


def test_uncached_reference_equals_the_engine(loop):
    engine = DiffusionEngine(EngineConfig(model="digits"))
    outputs = engine.generate([BUILTIN_PROMPTS["digits"][k] for k in range(3)],
                              [SamplingParams(seed=k, num_inference_steps=STEPS, guidance_scale=4.0, output_type="np")
                               for k in range(3)])
    images = np.stack([np.asarray(o.images[0], dtype=np.float32) for o in outputs])  # (3, 8, 8, 1)
    np.testing.assert_allclose(images, loop.reference.transpose(0, 2, 3, 1), atol=1e-4)


def test_skipping_forecasts_only_the_steps_left_out(loop):
    computed = {0, 1, 3, 5}
    latents, checks, skipped = loop.run(computed)
    assert skipped == pytest.approx(2 / STEPS)
    assert [step for step, _, _ in checks] == [3, 5]  # a check at each computed step after skips
    psnrs = loop.psnr(latents)
    assert np.all(np.isfinite(psnrs)) and np.all(psnrs > 10)
    # tripping every request at its first check computes every later step: closer to the reference
    tripped, _, skipped_tripped = loop.run(computed, trip=0.0)
    assert skipped_tripped == pytest.approx(1 / STEPS)
    assert np.mean(loop.psnr(tripped)) > np.mean(psnrs)


@pytest.mark.parametrize("argv, flag", [
    (["--computed-set", "1,2,3"], "--computed-set"),
    (["--computed-set", "0,x"], "--computed-set"),
    (["--computed-set", "0,25"], "--computed-set"),
    (["--thresholds", "-1"], "--thresholds"),
    (["--thresholds", "a"], "--thresholds"),
    (["--images", "0"], "--images"),
])
def test_bad_arguments_exit_with_a_usage_error_naming_the_flag(argv, flag, capsys):
    from cache_ceiling import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--experiment", "trip", *argv])
    assert exit_info.value.code == 2
    assert f"argument {flag}: invalid value" in capsys.readouterr().err
