"""Batch invariance: a request that shares denoiser forwards with different others (prompts,
seeds, step counts, guidance weights, negative prompts, images per prompt, input images) gives
what it gives alone, within float noise (`BATCH_TOL`)."""

from __future__ import annotations

import pytest
from tiny_models.registry import model_ids

from .harness import BATCH_TOL, assert_close, input_image, media, request_image, run

PROMPTS = ("a lighthouse at dusk", "a bowl of fruit on a marble kitchen counter, soft morning light", "snow")


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_batch_invariance(model, served):
    """Three requests with different prompts (of different token lengths), seeds, step counts
    and the family's per-request guidance (`TestModel.variations`) run together; each equals its
    solo run, and they really shared forwards."""
    output_type = "latent" if model.video else "np"  # video pixels are uint8: compare latents
    steps = (3, 2, 3)
    jobs = [(prompt, model.params(seed=11 + k, num_inference_steps=steps[k], output_type=output_type, **variation),
             request_image(model, seed=k))
            for k, (prompt, variation) in enumerate(zip(PROMPTS, model.variations))]
    outs = served.generate([j[0] for j in jobs], [j[1] for j in jobs], inputs=[j[2] for j in jobs])
    for k, (job, out) in enumerate(zip(jobs, outs)):
        assert_close(model, f"batch invariance (request {k})", media(out), media(run(served, *job)), BATCH_TOL)
    rows = sum(p.num_images_per_prompt * 2 for _, p, _ in jobs)  # every variation is guided
    assert max(outs[0].metrics.batch_sizes) == rows, \
        f"{model.id}: the three requests did not share a forward: {outs[0].metrics.batch_sizes}"


@pytest.mark.parametrize("model", model_ids(lambda m: m.images == "optional"), indirect=True)
def test_image_to_image_batches_with_text_to_image(model, served):
    """An image-to-image request and a text-to-image one share forwards and equal their solo runs."""
    edit = (PROMPTS[0], model.params(seed=1, num_inference_steps=4, strength=0.5, **model.guided),
            input_image(model, seed=2))
    t2i = (PROMPTS[1], model.params(seed=2, **model.guided), None)
    outs = served.generate([edit[0], t2i[0]], [edit[1], t2i[1]], inputs=[edit[2], t2i[2]])
    for name, job, out in (("image-to-image", edit, outs[0]), ("text-to-image", t2i, outs[1])):
        assert_close(model, f"batch invariance ({name} beside the other)", media(out), media(run(served, *job)),
                     BATCH_TOL)
    assert max(outs[0].metrics.batch_sizes) == 4, f"{model.id}: no shared forward: {outs[0].metrics.batch_sizes}"


@pytest.mark.parametrize("model", model_ids(lambda m: bool(m.mixed_sizes)), indirect=True)
def test_mixed_sizes_share_a_forward(model, served):
    """Requests of different sizes (`TestModel.mixed_sizes`; video: and frame counts), step
    counts and guidance weights, one of them image-to-image where the family takes input
    images, edits with references of different sizes (`TestModel.mixed_inputs`), run in ONE
    forward and each equals its solo run (`BATCH_TOL`; videos compare latents): every row
    keeps its own positions and attention span
    (`diffserve.pipelines.token_spans`)."""
    jobs = []
    output_type = "latent" if model.video else "np"
    for k, (height, width, *frames) in enumerate(model.mixed_sizes):
        variation = model.variations[k % len(model.variations)]
        size = dict(height=height, width=width, **({"num_frames": frames[0]} if frames else {}))
        params = model.params(seed=31 + k, num_inference_steps=2 + k % 2, output_type=output_type, **size,
                              **variation)
        image = request_image(model, seed=k)
        if model.mixed_inputs and image is not None:
            image = input_image(model, seed=k, size=model.mixed_inputs[k])
        if k == 1 and model.images == "optional":
            image = input_image(model, seed=k, size=(width, height))
            params = model.params(seed=31 + k, num_inference_steps=4, strength=0.5, **size, **variation)
        jobs.append((PROMPTS[k % len(PROMPTS)], params, image))
    outs = served.generate([j[0] for j in jobs], [j[1] for j in jobs], inputs=[j[2] for j in jobs])
    for k, (job, out) in enumerate(zip(jobs, outs)):
        assert _size(model, served, media(out)) == model.mixed_sizes[k], f"{model.id}: request {k} has the wrong size"
        assert_close(model, f"mixed sizes (request {k}, {model.mixed_sizes[k]})", media(out),
                     media(run(served, *job)), model.mixed_atol or BATCH_TOL)
    rows = sum(p.num_images_per_prompt * 2 for _, p, _ in jobs)
    assert max(outs[0].metrics.batch_sizes) == rows, \
        f"{model.id}: the requests of different sizes did not share a forward: {outs[0].metrics.batch_sizes}"


def _size(model, served, out) -> tuple[int, ...]:
    """(height, width) of images (N, H, W, C); (height, width, num_frames) of video latents
    (N, C, F_lat, h, w), through the VAE's factors."""
    if not model.video:
        return tuple(out.shape[1:3])
    pipe = served.runner.adapter.pipe
    spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    return out.shape[3] * spatial, out.shape[4] * spatial, (out.shape[2] - 1) * temporal + 1
