"""Image-to-image on SD3 folders (StableDiffusion3Img2ImgPipeline semantics) with the built-in
digits model: parity with diffusers across strengths, errors, and a quick judge of real edits
(parity at one strength and batching with text-to-image on every SD3 folder: tests/conformance/)."""

from __future__ import annotations


import numpy as np
import pytest
from diffusers import StableDiffusion3Img2ImgPipeline
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.models.digits import DEFAULT_MODEL_PATH
from seeds import per_image
from training.digits import data

TOL = 1e-4


@pytest.fixture(scope="module")
def digits():
    return DiffusionEngine(EngineConfig())


def _three(index=0) -> Image.Image:
    split = data.load_split()
    image = split.heldout_images[split.heldout_labels == 3][index] / data.MAX_INTENSITY
    return Image.fromarray((image * 255).round().astype(np.uint8))


def _reference(folder, prompt, image, **kw):
    pipe = StableDiffusion3Img2ImgPipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    seed, n = kw.pop("seed"), kw.pop("num_images_per_prompt", 1)
    return per_image(lambda generator: pipe(prompt, image=image, generator=generator, output_type="np", **kw).images,
                     seed, n)


@pytest.mark.parametrize("strength,steps,guidance", [(0.9, 20, 4.0), (0.2, 20, 4.0), (0.5, 6, 1.0), (1.0, 1, 4.0)])
def test_digits_img2img_matches_diffusers(digits, strength, steps, guidance):
    image = _three()
    [out] = digits.generate("the number eight", SamplingParams(
        seed=5, strength=strength, num_inference_steps=steps, guidance_scale=guidance, output_type="np"),
        inputs=image)
    assert out.ok, out.error
    ref = _reference(DEFAULT_MODEL_PATH, "the number eight", image.convert("L"), strength=strength,
                     num_inference_steps=steps, guidance_scale=guidance, seed=5)
    assert out.images.shape == ref.shape
    assert np.abs(out.images - ref).max() <= 1 / 255
    assert out.metrics.num_steps == int(steps * strength)  # only the last `strength` of the schedule


@pytest.mark.parametrize("kwargs,inputs,field", [
    ({"strength": 0.5}, None, "strength"),                       # strength without an image
    ({"strength": 1e-300}, "image", "strength"),                 # leaves no step (0.01 leaves one, as in diffusers)
    ({"strength": 1.5}, "image", "strength"),
    ({}, "two", "image"),
])
def test_img2img_errors_name_the_field(digits, kwargs, inputs, field):
    from diffserve.core.inputs import make_inputs

    image = _three()
    value = {None: None, "image": image, "two": make_inputs([image, image])}[inputs]
    with pytest.raises(InvalidRequestError) as info:
        digits.generate("x", SamplingParams(**kwargs), inputs=value)
    assert info.value.field == field


def test_unreadable_image_and_mismatched_mask_are_refused(digits):
    from diffserve.core.inputs import make_inputs

    with pytest.raises(InvalidRequestError) as info:
        digits.generate("x", SamplingParams(), inputs="not an image")
    assert info.value.field == "image"
    with pytest.raises(InvalidRequestError) as info:
        make_inputs(_three(), Image.new("L", (4, 4)))
    assert info.value.field == "mask"


def test_edit_three_into_eight_quick_judge(digits):
    """A quick run of `benchmarks/quality_img2img.py`'s measure (the full one uses 50 inputs):
    held-out 3s edited with "the number eight" at strength 0.9 are read as 8s; at 0.2 they stay
    closer to their input than two different 3s are to each other."""
    from quality import build_judge, judge_images
    from quality_img2img import reference_distances, source_images

    clf, _ = build_judge()
    inputs = source_images(3, 10)
    for strength in (0.9, 0.2):
        params = [SamplingParams(seed=i, strength=strength, output_type="np") for i in range(10)]
        outs = digits.generate(["the number eight"] * 10, params, inputs=list(inputs))
        images = np.concatenate([o.images for o in outs])[..., 0]
        if strength == 0.9:
            assert np.mean(judge_images(clf, images) == 8) >= 0.8
        else:
            same_digit, _ = reference_distances(3, 8)
            assert np.abs(images - inputs).mean() < same_digit
