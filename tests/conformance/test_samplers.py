"""Per-request samplers on every step-batched family: the ``scheduler`` names a family offers
(the documented table of `diffserve.pipelines.samplers`), each request's images equal diffusers'
pipeline with that scheduler set (at most one uint8 level), requests with different samplers
share every denoiser forward (flow-matching Euler rows and the others stepped per row in one
batch), and ``clip_skip`` / ``eta`` equal diffusers' arguments of those names where the family
takes them."""

from __future__ import annotations

import pytest
from tiny_models.registry import model_ids

from diffserve import InvalidRequestError
from diffserve.pipelines.stable_diffusion.adapter import expose_text_model

from .harness import PROMPT, assert_close, diffusers_reference, media, request_image

STEPS = 3  # multistep samplers run their second-order updates


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_every_sampler_matches_diffusers_in_one_shared_batch(model, folder, served):
    assert served.spec.samplers == model.samplers
    names = (None, *model.samplers)  # the folder's own scheduler beside every sampler
    image = request_image(model)
    per_batch = served.config.max_batch_size // 2  # CFG / true CFG: two rows per one-image request
    for start in range(0, len(names), per_batch):
        group = names[start:start + per_batch]
        params = [model.params(seed=20 + start + i, num_inference_steps=STEPS, scheduler=name, **model.guided)
                  for i, name in enumerate(group)]
        outs = served.generate([PROMPT] * len(group), params, inputs=image)
        for name, out in zip(group, outs):
            assert out.ok, f"{model.id} {name}: {out.error}"
            if len(group) > 1:  # one forward per step for all of them, whatever their sampler
                assert max(out.metrics.batch_sizes) == 2 * len(group), (name, out.metrics.batch_sizes)
            reference = diffusers_reference(model, folder, PROMPT, out.params, image)
            assert_close(model, f"sampler {name} vs diffusers", media(out), reference, model.parity_atol)


@pytest.mark.parametrize("model", model_ids(lambda m: m.pipeline in ("StableDiffusionPipeline",
                                                                    "StableDiffusionXLPipeline",
                                                                    "StableDiffusion3Pipeline")), indirect=True)
def test_clip_skip_matches_diffusers(model, folder, served):
    """CLIP families: ``clip_skip`` as diffusers' argument (prompt embeddings from an earlier
    CLIP layer), within its range; requests with and without it share forwards."""
    top = served.spec.max_clip_skip
    assert top is not None and top >= 1
    skipped, plain = served.generate([PROMPT, PROMPT], [model.params(seed=3, clip_skip=1, **model.guided),
                                                        model.params(seed=3, **model.guided)])
    assert max(skipped.metrics.batch_sizes) == 4, skipped.metrics.batch_sizes
    reference = diffusers_reference(model, folder, PROMPT, skipped.params, clip_skip=1,
                                    pipe=_clip_reference(model, folder))
    assert_close(model, "clip_skip=1 vs diffusers", media(skipped), reference, model.parity_atol)
    assert abs(media(skipped) - media(plain)).max() > 1e-4  # the embeddings changed
    with pytest.raises(InvalidRequestError, match=rf"clip_skip=.*\[1, {top}\]"):
        served.add_request(PROMPT, model.params(clip_skip=top + 1))


def _clip_reference(model, folder):
    """diffusers' pipeline of `model`, able to take ``clip_skip`` on transformers 5 (diffusers
    0.42.1's SD ``encode_prompt`` reads ``text_encoder.text_model``)."""
    from .harness import reference_pipeline

    pipe = reference_pipeline(model, folder)
    expose_text_model(pipe.text_encoder)
    return pipe


def test_fields_a_model_cannot_take_are_refused_by_name():
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    engine = DiffusionEngine(EngineConfig(model="digits-video", num_threads=1))
    try:
        for params, fragment in ((SamplingParams(scheduler="euler_a"), "one of euler, dpmpp_2m, unipc"),
                                 (SamplingParams(scheduler="Euler"), "one of euler, dpmpp_2m, unipc"),
                                 (SamplingParams(clip_skip=1), "unset: WanPipeline has no CLIP text encoder"),
                                 (SamplingParams(eta=0.5), "eta applies to DDIM-type schedulers"),
                                 (SamplingParams(eta=2.0), r"eta=2.0: must be a number in \[0, 1\]")):
            with pytest.raises(InvalidRequestError, match=fragment):
                engine.add_request("a handwritten digit 3 moving left", params)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", model_ids(lambda m: m.pipeline == "StableDiffusionPipeline"), indirect=True)
def test_ddim_eta_matches_diffusers(model, folder, served):
    params = model.params(seed=9, num_inference_steps=STEPS, scheduler="ddim", eta=0.7, **model.guided)
    [out] = served.generate(PROMPT, params)
    reference = diffusers_reference(model, folder, PROMPT, out.params, eta=0.7)
    assert_close(model, "ddim eta=0.7 vs diffusers", media(out), reference, model.parity_atol)
    with pytest.raises(InvalidRequestError, match="eta applies to DDIM-type schedulers.*EulerDiscreteScheduler"):
        served.add_request(PROMPT, model.params(scheduler="euler", eta=0.5))


@pytest.mark.parametrize("model", model_ids(lambda m: m.images == "optional"), indirect=True)
def test_image_to_image_takes_only_samplers_that_noise_an_image(model, served):
    from .harness import input_image

    assert served.spec.image_samplers == ("euler",)  # what StableDiffusion3Img2ImgPipeline can run
    with pytest.raises(InvalidRequestError, match="scheduler.*one of euler or null with an input image"):
        served.add_request(PROMPT, model.params(scheduler="dpmpp_2m", strength=0.5), inputs=input_image(model))


def test_the_table_names_the_samplers_core_lists():
    from diffserve.core.sampling_params import SAMPLER_NAMES
    from diffserve.pipelines.samplers import SAMPLERS

    assert tuple(SAMPLERS) == SAMPLER_NAMES
