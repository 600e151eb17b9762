"""Cache backends on every family: each either runs (the steps it computes equal the plain
forward; when it skips, a batched request equals its solo run with the same backend, so its
caching state is its own) or is refused by name at startup. (``none`` is every other check of the
suite; regional compile has its focused tests: a cold compile takes 10-45 s on CPU.)"""

from __future__ import annotations

import pytest
from tiny_models.registry import CACHE_BACKENDS, model_ids

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError

from .harness import BATCH_TOL, PROMPT, assert_close, max_difference, media, request_image, run

#: Options that skip whenever allowed (random weights change a lot between steps), but never in
#: a request's first two steps: TeaCache always computes the first and the last step, cache-dit
#: its warm-up steps. A 2-step request thus runs the backend's own forward at every step.
SKIPPING = {"teacache": {"rel_l1_thresh": 1e9},
            "cache_dit": {"Fn_compute_blocks": 1, "residual_diff_threshold": 1e9, "max_warmup_steps": 2}}


def _engine(folder, backend, options):
    return DiffusionEngine(EngineConfig(model=str(folder), cache_backend=backend, cache_config=options))


def _cache_stats(engine) -> dict:
    return engine.stats()["acceleration"]["cache_backend"]


@pytest.mark.parametrize("backend", CACHE_BACKENDS)
@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_cache_backend_runs_or_is_refused_by_name(model, folder, served, backend):
    if not model.backends[backend]:
        with pytest.raises(InvalidRequestError) as info:
            _engine(folder, backend, {})
        message = str(info.value)
        assert info.value.field == "cache_backend", f"{model.id}: {backend} refused naming {info.value.field!r}"
        assert model.pipeline in message and backend in message and "\n" not in message, message
        return
    output_type = "latent" if model.video else "np"
    image = request_image(model)
    engine = _engine(folder, backend, SKIPPING[backend])
    computed = (PROMPT, model.params(seed=3, output_type=output_type, **model.guided), image)  # 2 steps
    assert_close(model, f"{backend} computed steps vs no cache", media(run(engine, *computed)),
                 media(run(served, *computed)), 1e-5)
    assert _cache_stats(engine)["skipped"] == 0, f"{model.id}: {backend} skipped a step it must compute"

    job = (PROMPT, model.params(seed=3, num_inference_steps=4, output_type=output_type, **model.guided), image)
    other = ("a small red kite in the wind",
             model.params(seed=4, num_inference_steps=3, output_type=output_type, **model.variations[1]), image)
    outs = engine.generate([job[0], other[0]], [job[1], other[1]], inputs=[job[2], other[2]])
    assert _cache_stats(engine)["skipped"] > 0, f"{model.id}: {backend} skipped nothing: {_cache_stats(engine)}"
    for k, (j, out) in enumerate(zip((job, other), outs)):
        # solo runs after the batch on the same engine: no caching state leaks between requests
        assert_close(model, f"{backend} batched vs solo (request {k})", media(out), media(run(engine, *j)),
                     BATCH_TOL)
    assert max_difference(media(outs[0]), media(run(served, *job))) > 1e-3, \
        f"{model.id}: {backend} skipped steps changed nothing"
    engine.shutdown()


#: Quality levels that skip on random weights (`SamplingParams.cache_quality`; no guard).
LEVELS = {"fast": {"interval": 3, "warmup_steps": 1, "budget": None},
          "high": {"interval": 2, "warmup_steps": 1, "budget": None}}


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_quality_levels_share_batches_on_every_teacache_family(model, folder):
    """Requests of two forecasting levels batched together each equal their solo run, on every
    family TeaCache supports (the others refuse the backend by name: the test above)."""
    if not model.backends["teacache"]:
        pytest.skip(f"{model.id}: teacache is refused by name (checked above)")
    output_type = "latent" if model.video else "np"
    image = request_image(model)
    engine = _engine(folder, "teacache", {"levels": LEVELS})
    job = (PROMPT, model.params(seed=3, num_inference_steps=6, output_type=output_type, cache_quality="fast",
                                **model.guided), image)
    other = ("a small red kite in the wind",
             model.params(seed=4, num_inference_steps=5, output_type=output_type, cache_quality="high",
                          **model.variations[1]), image)
    outs = engine.generate([job[0], other[0]], [job[1], other[1]], inputs=[job[2], other[2]])
    assert all(o.metrics.cache_skipped_steps > 0 for o in outs), [o.metrics.as_dict() for o in outs]
    for k, (j, out) in enumerate(zip((job, other), outs)):
        assert_close(model, f"level {j[1].cache_quality} batched vs solo (request {k})", media(out),
                     media(run(engine, *j)), BATCH_TOL)
    engine.shutdown()
