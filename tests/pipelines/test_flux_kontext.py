"""FluxKontextPipeline quirks: reference images of other sizes than the output (cut to multiples of
16) equal diffusers' edits, co-batched references of one encoded size, references of different
sizes in one forward (per-row reference ids and mask; in the batch key only with mixing off),
input checks, CLI refusal. (Parity, batching, refusals, cache backends:
tests/conformance/.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline, FluxPipeline
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


def test_references_of_different_sizes_share_a_forward(kontext):
    """References cut to 64x48, 32x32 and 80x32 beside outputs of three sizes (one request of two
    images) run in ONE forward: each row's reference tokens are padded to the longest, rotated
    by the ids (1, row, col) of its own grid and its padded keys masked; each equals its solo
    run."""
    images = [_image(1, 64, 48), _image(2, 32, 32), _image(3, 85, 40)]
    jobs = [("make it red", _p(1, steps=3)), ("make it blue", _p(2, steps=2, height=32, width=48, guidance_scale=2.0)),
            ("add a hat", _p(3, steps=4, height=64, width=64, guidance_scale=5.0, num_images_per_prompt=2))]
    outs = kontext.generate([j[0] for j in jobs], [j[1] for j in jobs], inputs=images)
    assert [max(o.metrics.batch_sizes) for o in outs] == [4, 4, 4]  # 1 + 1 + 2 images
    for out, job, image in zip(outs, jobs, images):
        assert out.ok, out.error
        assert out.images.shape[1:3] == (job[1].height, job[1].width)
        assert np.abs(out.images - _run(kontext, *job, image).images).max() <= TOL


def test_no_mixed_sizes_keeps_the_reference_size_in_the_batch_key(tiny_flux_kontext_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_flux_kontext_dir), mixed_sizes=False))
    outs = engine.generate(["a", "b"], [_p(1), _p(2)], inputs=[_image(1, 64, 48), _image(2, 32, 32)])
    assert [max(o.metrics.batch_sizes) for o in outs] == [1, 1]


def test_row_tables_give_each_reference_its_own_ids_and_mask():
    """`RowRotary.tables` puts each row's own reference table (`FluxPosEmbed` of the ids
    (1, row, col) of its grid) after its noisy tokens, the identity on padding; `attention_bias`
    masks the padded noisy AND reference keys."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    from diffserve.pipelines.flux.mixed_sizes import FluxSpans, RowRotary
    from diffserve.pipelines.row_data import RowData, forward_rows
    from diffserve.pipelines.token_spans import (IMAGE_TOKENS, LATENT_SIZE, REFERENCE_SIZE, REFERENCE_TOKENS,
                                                 attention_bias)

    rotary, cpu = RowRotary(10000, (4, 6, 6)), torch.device("cpu")
    # row 0: 2x2 noisy grid, 1x1 reference; row 1: 1x2 noisy grid, 2x1 reference (latent pixels = 2 x tokens)
    rows = RowData({LATENT_SIZE: ((4, 4), (2, 4)), IMAGE_TOKENS: (4, 2),
                    REFERENCE_SIZE: ((2, 2), (4, 2)), REFERENCE_TOKENS: (1, 2)}, 2)
    spans = FluxSpans(text=3, longest=4, ids_dtype=torch.float32, reference=2)
    shared = (torch.full((9, 16), 7.0), torch.full((9, 16), 7.0))  # text keeps the shared table
    with forward_rows(rows):
        cos, sin = rotary.tables(spans, shared)
        bias = attention_bias(spans.longest, 9, torch.float32, cpu, image_start=3, reference=2)
    embed = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])

    def table(height, width, first_id):
        ids = FluxPipeline._prepare_latent_image_ids(None, height, width, cpu, torch.float32)
        ids[:, 0] = first_id
        return embed(ids)

    for r, (grid, ref_grid) in enumerate((((2, 2), (1, 1)), ((1, 2), (2, 1)))):
        n, m = grid[0] * grid[1], ref_grid[0] * ref_grid[1]
        for got, want, ref_want in zip((cos[r], sin[r]), table(*grid, 0), table(*ref_grid, 1)):
            assert torch.equal(got[:3], torch.full((3, 16), 7.0))
            torch.testing.assert_close(got[3:3 + n], want)
            torch.testing.assert_close(got[7:7 + m], ref_want)
        assert (cos[r, 3 + n:7] == 1).all() and (sin[r, 3 + n:7] == 0).all()
        assert (cos[r, 7 + m:] == 1).all() and (sin[r, 7 + m:] == 0).all()
    masked = torch.isinf(bias[:, 0, 0])
    assert masked.tolist() == [[False] * 8 + [True], [False] * 5 + [True, True, False, False]]


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


# ------------------------------------------------------------------------ acceleration
def test_mixed_references_with_lora_rows_and_teacache(tiny_flux_kontext_dir, tmp_path, monkeypatch):
    """A LoRA edit with one reference size and a plain edit with another share forwards under
    TeaCache: when only one of them computes its blocks (`narrowed_rows`), its reference table,
    reference mask and adapters follow the computed rows, and each equals its run alone."""
    from tiny_models.loras import random_lora, save_diffusers_lora

    from diffserve.acceleration import teacache

    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    lora = save_diffusers_lora(FluxKontextPipeline, tmp_path / "a", {"transformer": (
        random_lora(pipe.transformer, ("to_q", "to_k", "to_v", "to_out.0"), 2, seed=3), 2, 2.0)})
    engine = DiffusionEngine(EngineConfig(model=str(tiny_flux_kontext_dir), cache_backend="teacache",
                                          cache_config={"rel_l1_thresh": 100.0}, loras={"a": str(lora)},
                                          overlap_stages=False))
    small = ("make it red", _p(1, steps=4, height=32, width=48, loras={"a": 1.0}), _image(1, 32, 32))
    large = ("add a hat", _p(2, steps=8, height=64, width=48, guidance_scale=5.0), _image(2, 80, 48))
    subsets = []
    narrowed_rows = teacache.narrowed_rows
    monkeypatch.setattr(teacache, "narrowed_rows", lambda index: subsets.append(list(index)) or narrowed_rows(index))
    together = engine.generate([small[0], large[0]], [small[1], large[1]], inputs=[small[2], large[2]])
    monkeypatch.setattr(teacache, "narrowed_rows", narrowed_rows)
    assert max(together[0].metrics.batch_sizes) == 2
    assert subsets and all(len(rows) == 1 for rows in subsets)  # one request's row computed alone
    for out, job in zip(together, (small, large)):
        assert out.ok, out.error
        assert np.abs(out.images - _run(engine, *job).images).max() <= TOL


def test_regional_compile_without_recompiles_across_reference_sizes(tmp_path, fresh_dynamo):
    """Compiled blocks warmed up at the default size serve forwards whose references (and
    outputs) differ in size, in different compositions, without recompiling."""
    import json

    from tiny_models import build_tiny_flux_kontext

    folder = build_tiny_flux_kontext(tmp_path / "kontext", num_layers=1, num_single_layers=1)
    (folder / "generation_config.json").write_text(json.dumps({"height": 32, "width": 32, "max_sequence_length": L}))
    engine = DiffusionEngine(EngineConfig(model=str(folder), compile=True, max_batch_size=2))
    eager = DiffusionEngine(EngineConfig(model=str(folder)))
    jobs = [("a", _p(1, steps=2, height=32, width=32), _image(1, 32, 32)),
            ("b", _p(2, steps=2, height=32, width=32), _image(2, 48, 32)),
            ("c", _p(3, steps=2, height=48, width=32), _image(3, 32, 64))]
    for pair in (jobs[:2], jobs[1:]):
        outs = engine.generate([j[0] for j in pair], [j[1] for j in pair], inputs=[j[2] for j in pair])
        assert [max(o.metrics.batch_sizes) for o in outs] == [2, 2]
        for out, job in zip(outs, pair):
            assert np.abs(out.images - _run(eager, *job).images).max() <= TOL
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["graphs_compiled"] >= 1
    assert stats["recompiles_after_warmup"] == 0
