"""FluxKontextPipeline quirks: reference images of other sizes than the output (cut to multiples of
16) equal diffusers' edits, co-batched references of different sizes encoded alike, the reference
size in the batch key, input checks, CLI refusal. (Parity, batching, refusals, cache backends:
tests/conformance/.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main

TOL = 1e-4
L = 32  # max_sequence_length


@pytest.fixture(scope="module")
def kontext(tiny_flux_kontext_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_flux_kontext_dir)))


def _image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _p(seed, steps=3, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, **{"output_type": "np", "max_sequence_length": L,
                                                                    "height": 48, "width": 64, **kw})


def _run(engine, prompt, params, image):
    [out] = engine.generate(prompt, params, inputs=image)
    assert out.ok, out.error
    return out


CASES = {  # id: (output WxH, reference WxH, steps, guidance, true_cfg_scale, negative_prompt, rows)
    "reference-cut-to-16": ((48, 64), (50, 37), 2, 2.0, 1.0, None, 1),
    "other-reference-size": ((64, 64), (32, 48), 1, 3.5, 1.0, None, 1),
    "true-cfg-other-reference-size": ((64, 48), (80, 32), 2, 2.0, 4.0, "blurry", 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(kontext, tiny_flux_kontext_dir, case):
    (width, height), (iw, ih), steps, guidance, true_cfg, negative, rows = CASES[case]
    image = _image(1, iw, ih)
    kw = dict(num_inference_steps=steps, height=height, width=width, guidance_scale=guidance, true_cfg_scale=true_cfg,
              negative_prompt=negative, max_sequence_length=L)
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    pipe.set_progress_bar_config(disable=True)
    # diffserve's size rule = diffusers with max_area=height*width and _auto_resize=False
    ref = pipe(image=image, prompt="make it red", generator=torch.Generator("cpu").manual_seed(7), output_type="np",
               max_area=height * width, _auto_resize=False, **kw).images
    out = _run(kontext, "make it red", SamplingParams(seed=7, output_type="np", **kw), image)
    assert out.images.shape == ref.shape == (1, height, width, 3)
    assert np.abs(out.images - ref).max() <= 1e-5  # measured: 0 without true CFG, ~1e-6 with
    assert out.metrics.batch_sizes == {rows: steps}


def test_cobatched_edits_with_different_images_equal_solo_runs(kontext):
    # 70x50 is encoded at 64x48 like the others: all three share forwards
    images = [_image(1, 64, 48), _image(2, 64, 48), _image(3, 70, 50)]
    jobs = [("make it red", _p(1, steps=4)), ("make it blue", _p(2, steps=3, guidance_scale=2.0)),
            ("add a hat", _p(3, steps=5, guidance_scale=5.0, num_images_per_prompt=2))]
    outs = kontext.generate([j[0] for j in jobs], [j[1] for j in jobs], inputs=images)
    for out, job, image in zip(outs, jobs, images):
        assert out.ok, out.error
        assert np.abs(out.images - _run(kontext, *job, image).images).max() <= TOL
    assert max(outs[0].metrics.batch_sizes) == 4  # 1 + 1 + 2 images in one forward


def test_reference_size_is_part_of_the_batch_key(kontext):
    outs = kontext.generate(["a", "b"], [_p(1), _p(2)], inputs=[_image(1, 64, 48), _image(2, 32, 32)])
    assert [max(o.metrics.batch_sizes) for o in outs] == [1, 1]


@pytest.mark.parametrize("inputs,field", [
    ([_image(1, 32, 32), _image(2, 32, 32)], "image"),
    ([_image(1, 15, 40)], "image"),  # no 16-pixel column left
])
def test_inputs_are_checked(kontext, inputs, field):
    with pytest.raises(InvalidRequestError) as info:
        kontext.add_request("make it red", _p(1), inputs=inputs)
    assert info.value.field == field


def test_cli_generate_without_an_image_is_one_line_error(tiny_flux_kontext_dir, tmp_path, capsys):
    rc = main(["generate", "--model", str(tiny_flux_kontext_dir), "--prompt", "a cat", "--size", "32x32",
               "-o", str(tmp_path)])
    assert rc == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("diffserve: error:") and "image" in line and "FluxKontextPipeline" in line
