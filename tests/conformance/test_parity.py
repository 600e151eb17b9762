"""Every family's images (videos) equal its own diffusers pipeline's ``__call__`` for the same
request and seed: at most one uint8 level apart (tighter where the registry says it measured so),
with exactly the denoiser forwards diffusers runs (one per step; CFG doubles its rows)."""

from __future__ import annotations

import pytest
from tiny_models.registry import MODELS, model_ids

from .harness import PROMPT, assert_close, diffusers_reference, input_image, media, request_image, run


CASES = {  # case: (guided, images per prompt, steps)
    "guided": (True, 2, 2),
    "unguided": (False, 1, 2),
    "one-step": (True, 1, 1),
}


def _cases():
    return [pytest.param(m.id, case, id=f"{m.id}-{case}") for m in MODELS for case in CASES
            if case != "one-step" or m.one_step]


@pytest.mark.parametrize("model,case", _cases(), indirect=["model"])
def test_matches_diffusers(model, folder, served, case):
    """``guided``: the family's guidance on (CFG / true CFG / embedded), a negative prompt, two
    images per prompt; ``unguided``: guidance off, one image; ``one-step``: a one-step schedule."""
    guided, n, steps = CASES[case]
    params = model.params(seed=7, num_images_per_prompt=n, num_inference_steps=steps,
                          **(model.guided if guided else model.unguided))
    image = request_image(model)
    out = run(served, PROMPT, params, image)
    reference = diffusers_reference(model, folder, PROMPT, out.params, image)
    got = media(out)
    assert got.shape[0] == n
    assert_close(model, f"diffusers parity ({case})", got, reference, model.parity_atol)
    rows = n * (2 if guided else 1)
    assert out.metrics.batch_sizes == {rows: model.forwards(params.num_inference_steps)}, \
        f"{model.id}: expected one forward of {rows} rows per denoising step"


@pytest.mark.parametrize("model", model_ids(lambda m: m.images == "optional"), indirect=True)
def test_image_to_image_matches_diffusers(model, folder, served):
    """Image-to-image (families that take an optional input image): diffusers' img2img pipeline,
    the last ``strength`` of the schedule."""
    image = input_image(model, seed=1)
    params = model.params(seed=5, num_inference_steps=4, strength=0.5, num_images_per_prompt=2, **model.guided)
    out = run(served, PROMPT, params, image)
    reference = diffusers_reference(model, folder, PROMPT, out.params, image, cls=model.img2img_reference)
    assert_close(model, "img2img diffusers parity", media(out), reference, 1 / 255)
    assert out.metrics.num_steps == 2  # int(4 x 0.5): only the end of the schedule runs
