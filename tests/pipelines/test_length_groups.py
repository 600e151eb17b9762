"""Length groups (`diffserve.pipelines.length_groups`): an eager mixed-size SD3, Flux (also
Kontext) or Qwen-Image (also Qwen-Image-Edit) forward runs each repeated block once per row size
on real tokens only, equal to the padded masked forward and to each row's solo forward; compiled
blocks and the config switch keep the padded path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.pipelines import length_groups as lg
from diffserve.pipelines.row_data import RowData, current_rows, forward_rows, narrowed_rows
from diffserve.pipelines.token_spans import (IMAGE_TOKENS, LATENT_SIZE, REFERENCE_SIZE, REFERENCE_TOKENS,
                                             TokenLayout)

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("always_group")  # the grouped path's mechanics, at tiny sizes


def test_groups_by_token_count_memoised_and_inert_when_uniform(monkeypatch):
    with forward_rows(RowData({IMAGE_TOKENS: (4, 2, 4, 1, 2)}, 5)):
        groups = lg.length_groups(4, CPU)
        assert [(g.tokens, g.members, g.rows.tolist()) for g in groups] == [
            (1, (3,), [3]), (2, (1, 4), [1, 4]), (4, (0, 2), [0, 2])]
        assert lg.length_groups(4, CPU) is groups  # once per forward layout
        with pytest.raises(ValueError, match="5 tokens in a forward padded to 4"):
            with forward_rows(RowData({IMAGE_TOKENS: (5, 2)}, 2)):
                lg.length_groups(4, CPU)
    assert lg.length_groups(4, CPU) is None  # outside a forward
    with forward_rows(RowData({IMAGE_TOKENS: (4, 4)}, 2)):
        assert lg.length_groups(4, CPU) is None  # nothing padded
    with forward_rows(RowData({IMAGE_TOKENS: (4, 2)}, 2)):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert lg.length_groups(4, CPU) is None  # a traced block keeps the padded path


def test_small_padding_keeps_one_padded_call(monkeypatch):
    """A forward groups only when its padding pays for the extra block calls: at least
    `MIN_PADDED_TOKENS_PER_CALL` padded token slots per extra call (the built-in model's forwards
    pad a few dozen and stay one padded call; a 1024- and two 256-token rows group)."""
    monkeypatch.setattr(lg, "MIN_PADDED_TOKENS_PER_CALL", 256)
    assert not lg.worth_grouping([16, 8, 4, 4], 16, 3)  # 20 padded slots < 2 x 256
    assert lg.worth_grouping([1024, 256, 256], 1024, 2)  # 1536 >= 256
    assert not lg.worth_grouping([1024, 1000, 900, 800], 1024, 4)  # 372 < 3 x 256
    with forward_rows(RowData({IMAGE_TOKENS: (16, 8, 4, 4)}, 4)):
        assert lg.length_groups(16, CPU) is None
    with forward_rows(RowData({IMAGE_TOKENS: (1024, 256, 256)}, 3)):
        assert [g.tokens for g in lg.length_groups(1024, CPU)] == [256, 1024]
    with forward_rows(RowData({IMAGE_TOKENS: (300, 100), REFERENCE_TOKENS: (0, 400)}, 2)):
        # pairs (300, 0) and (100, 400) of 300 + 400 slots: 300 padded slots >= 256
        assert len(lg.length_groups(300, CPU, reference=400)) == 2


def test_groups_by_token_and_reference_count_pairs():
    """With a second padded segment (Kontext's references) rows group by (n, m); nothing to do
    only when both segments are full on every row."""
    rows = RowData({IMAGE_TOKENS: (4, 4, 2, 4), REFERENCE_TOKENS: (3, 1, 3, 3)}, 4)
    with forward_rows(rows):
        groups = lg.length_groups(4, CPU, reference=3)
        assert [(g.tokens, g.reference, g.members) for g in groups] == [(2, 3, (2,)), (4, 1, (1,)), (4, 3, (0, 3))]
        assert [g.members for g in lg.length_groups(4, CPU)] == [(2,), (0, 1, 3)]  # without: by n only
        with pytest.raises(ValueError, match="3 reference tokens in a forward padded to 2"):
            lg.length_groups(4, CPU, reference=2)
        with narrowed_rows((0, 3)) as first:
            assert first[REFERENCE_TOKENS] == (3, 3)
        with narrowed_rows((0, 3)) as again:
            assert again is first  # one RowData per group and batch composition: derived values reused
    with forward_rows(RowData({IMAGE_TOKENS: (4, 4), REFERENCE_TOKENS: (3, 3)}, 2)):
        assert lg.length_groups(4, CPU, reference=3) is None
        assert lg.length_groups(4, CPU, reference=5) is not None  # both rows' references padded


def test_gather_and_scatter_rows():
    x = torch.arange(24.0).reshape(3, 4, 2)
    group = lg.LengthGroup((0, 2), torch.tensor([0, 2]), 3)
    picked = lg.gather_rows(x, group, group.tokens)
    assert torch.equal(picked, x[[0, 2], :3])
    out = torch.zeros_like(x)
    lg.scatter_rows(out, group, picked)
    assert torch.equal(out[[0, 2], :3], x[[0, 2], :3]) and not out[1].any() and not out[:, 3].any()


def _tiny_transformer(grouped):
    from diffusers import SD3Transformer2DModel

    from diffserve.pipelines.sd3.mixed_sizes import install_token_spans

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                  pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16).eval()
    install_token_spans(model, folded=False, grouped=grouped)
    return model


def test_sd3_blocks_run_per_size_and_equal_padded_and_solo():
    """Four rows of three sizes: each block runs once per size (on g rows x n tokens, with the
    forward context narrowed to them), the output equals the padded masked forward (switch
    off) on every row's region and each row's solo forward."""
    switch = {"on": True}
    model = _tiny_transformer(lambda: switch["on"])
    sizes, grid = [(8, 8), (4, 8), (8, 4), (4, 4)], (8, 8)
    torch.manual_seed(2)
    latents = torch.zeros(4, 4, *grid)
    for r, (h, w) in enumerate(sizes):
        latents[r, :, :h, :w] = torch.randn(4, h, w)
    ctx, pooled, t = torch.randn(4, 7, 32), torch.randn(4, 64), torch.tensor([900.0, 500.0, 100.0, 700.0])
    layout = TokenLayout(sizes, grid, patch=2)
    rows = RowData({LATENT_SIZE: tuple(sizes), IMAGE_TOKENS: tuple(layout.tokens)}, 4)
    seen = []
    block = model.transformer_blocks[0]
    hook = block.attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["hidden_states"].shape[:2], current_rows().num_rows)),
        with_kwargs=True)

    def forward():
        with torch.no_grad(), forward_rows(rows):
            out = model(hidden_states=layout.to_strip(latents), encoder_hidden_states=ctx, pooled_projections=pooled,
                        timestep=t, joint_attention_kwargs={"spans": True}).sample
        return layout.from_strip(out)

    grouped = forward()
    assert seen == [((1, 4), 1), ((2, 8), 2), ((1, 16), 1)]  # 4x4 | 4x8 + 8x4 | 8x8, real tokens only
    switch["on"] = False
    seen.clear()
    padded = forward()
    assert seen == [((4, 16), 4)]  # one call over the padded strip
    hook.remove()
    torch.testing.assert_close(grouped, padded, atol=1e-5, rtol=1e-4)
    for r, (h, w) in enumerate(sizes):
        with torch.no_grad():
            solo = model(hidden_states=latents[r:r + 1, :, :h, :w], encoder_hidden_states=ctx[r:r + 1],
                         pooled_projections=pooled[r:r + 1], timestep=t[r:r + 1]).sample
        torch.testing.assert_close(grouped[r:r + 1, :, :h, :w], solo, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length_groups", [True, False])
def test_engine_mixed_batch_equals_solo_either_way(tiny_sd3_dir, one_torch_thread, length_groups):
    """Through the engine (CFG rows, context folding): requests of three sizes in one step batch
    each equal their solo run, with and without `EngineConfig.length_groups`."""
    _mixed_engine_batch_equals_solo(tiny_sd3_dir, length_groups)


def _mixed_engine_batch_equals_solo(folder, length_groups: bool, **params) -> None:
    """Three requests (64x64, 32x64, 64x32, guided: two rows each) in every forward of an engine
    on `folder`: the switch reaches the adapter and `padding_free`; block 0's attention runs
    once per token count (16 tokens | 8: 32x64 and 64x32 share one) with length groups, once
    over the padded rows without; each image equals its solo run within 1e-4."""
    engine = DiffusionEngine(EngineConfig(model=str(folder), max_batch_size=8, length_groups=length_groups))
    assert engine.runner.adapter.length_groups is length_groups
    assert engine.model_info.padding_free is length_groups  # the request scheduler's cost model counts real tokens
    prompts = ["a red kite", "snow", "a lighthouse at dusk"]
    params = [SamplingParams(num_inference_steps=3, seed=10 + i, height=h, width=w, output_type="np", **params)
              for i, (h, w) in enumerate([(64, 64), (32, 64), (64, 32)])]
    calls = []
    attn = engine.runner.adapter.pipe.transformer.transformer_blocks[0].attn
    hook = attn.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    batched = engine.generate(prompts, params)
    hook.remove()
    stats = engine.stats()["scheduler"]
    assert stats["mean_rows_per_forward"] == 6  # three sizes x two guidance rows in every forward
    assert len(calls) == stats["forwards"] * (2 if length_groups else 1)
    for prompt, p, out in zip(prompts, params, batched):
        assert out.ok, out.error
        [solo] = engine.generate([prompt], [p])
        assert float(np.abs(out.images - solo.images).max()) <= 1e-4


def test_compiled_blocks_keep_the_padded_path(tmp_path_factory, one_torch_thread):
    """Regional compile wraps the grouped block forward: traced, it takes the padded masked path
    (no data-dependent grouping in the graph), equals eager within float rounding and compiles
    nothing after warm-up."""
    from tiny_models import build_tiny_sd3

    folder = build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_groups"), num_layers=1)
    prompts = ["a", "b", "c"]
    params = [SamplingParams(num_inference_steps=3, seed=i, height=h, width=w, output_type="np")
              for i, (h, w) in enumerate([(64, 64), (32, 64), (48, 32)])]
    compiled = DiffusionEngine(EngineConfig(model=str(folder), compile=True, max_batch_size=6))
    eager = DiffusionEngine(EngineConfig(model=str(folder), max_batch_size=6))
    for a, b in zip(compiled.generate(prompts, params), eager.generate(prompts, params)):
        assert float(np.abs(a.images - b.images).max()) <= 1e-4
    assert compiled.runner.acceleration_stats()["compile"]["recompiles_after_warmup"] == 0
    assert not compiled.model_info.padding_free and eager.model_info.padding_free


def _tiny_flux(grouped):
    from diffusers import FluxTransformer2DModel

    from diffserve.pipelines.flux.mixed_sizes import install_token_spans

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]).eval()
    install_token_spans(model, grouped=grouped)
    return model


def _flux_ids(latent_size, first_id=0):
    from diffusers import FluxPipeline

    ids = FluxPipeline._prepare_latent_image_ids(None, latent_size[0] // 2, latent_size[1] // 2, CPU, torch.float32)
    ids[:, 0] = first_id
    return ids


@pytest.mark.parametrize("kontext", [False, True])
def test_flux_blocks_run_per_size_and_equal_padded_and_solo(kontext):
    """Four rows of three token counts (two of them 4x8 and 8x4 latents: one count, own RoPE
    ids), Kontext with references of three sizes after them: both block kinds run once per
    (noisy, reference) count on real tokens only, with the forward context narrowed; every
    row's noisy tokens equal the padded masked forward (switch off) and its solo forward."""
    from diffserve.pipelines.flux.mixed_sizes import FluxSpans

    switch = {"on": True}
    model = _tiny_flux(lambda: switch["on"])
    sizes = [(8, 8), (4, 8), (8, 4), (4, 4)]  # latent pixels; 2x2 patches per token
    refs = [(4, 4), (4, 4), (4, 4), (8, 4)] if kontext else [None] * 4
    tokens = [h * w // 4 for h, w in sizes]
    ref_tokens = [h * w // 4 if kontext else 0 for h, w in refs] if kontext else [0] * 4
    longest, reference, text = max(tokens), max(ref_tokens), 5
    g = torch.Generator().manual_seed(1)
    noisy = [torch.randn(n, 16, generator=g) for n in tokens]
    ref = [torch.randn(m, 16, generator=g) for m in ref_tokens]
    hidden = torch.zeros(4, longest + reference, 16)
    for r in range(4):
        hidden[r, :tokens[r]] = noisy[r]
        hidden[r, longest:longest + ref_tokens[r]] = ref[r]
    ctx, pooled = torch.randn(4, text, 32, generator=g), torch.randn(4, 32, generator=g)
    t, txt_ids = torch.tensor([0.9, 0.5, 0.1, 0.7]), torch.zeros(text, 3)
    img_ids = torch.zeros(longest + reference, 3)  # the processors give each row its own
    data = {LATENT_SIZE: tuple(sizes), IMAGE_TOKENS: tuple(tokens)}
    if kontext:
        data.update({REFERENCE_SIZE: tuple(refs), REFERENCE_TOKENS: tuple(ref_tokens)})
    rows = RowData(data, 4)
    spans = FluxSpans(text, longest, torch.float32, reference)
    seen = []
    for block in (model.transformer_blocks[0], model.single_transformer_blocks[0]):
        block.attn.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((tuple(kwargs["hidden_states"].shape[:2]),
                                                      current_rows().num_rows)), with_kwargs=True)

    def forward():
        with torch.no_grad(), forward_rows(rows):
            return model(hidden_states=hidden, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t,
                         img_ids=img_ids, txt_ids=txt_ids, joint_attention_kwargs={"spans": spans}).sample

    grouped = forward()
    if kontext:  # (n, m) = (4, 8) | (8, 4) x2 | (16, 4): noisy + reference tokens (+ 5 text in single blocks)
        double = [((1, 12), 1), ((2, 12), 2), ((1, 20), 1)]
    else:  # n = 4 | 8 (4x8 and 8x4) | 16
        double = [((1, 4), 1), ((2, 8), 2), ((1, 16), 1)]
    assert seen == double + [((g_, n + text), rows_) for (g_, n), rows_ in double]
    switch["on"] = False
    seen.clear()
    padded = forward()
    assert seen == [((4, longest + reference), 4), ((4, text + longest + reference), 4)]  # padded, masked
    for r, (size, n, m) in enumerate(zip(sizes, tokens, ref_tokens)):
        torch.testing.assert_close(grouped[r, :n], padded[r, :n], atol=1e-5, rtol=1e-4)
        solo_ids = torch.cat([_flux_ids(size), _flux_ids(refs[r], 1)]) if kontext else _flux_ids(size)
        with torch.no_grad():
            solo = model(hidden_states=torch.cat([noisy[r], ref[r]])[None], encoder_hidden_states=ctx[r:r + 1],
                         pooled_projections=pooled[r:r + 1], timestep=t[r:r + 1], img_ids=solo_ids,
                         txt_ids=txt_ids).sample
        torch.testing.assert_close(grouped[r, :n], solo[0, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length_groups", [True, False])
def test_flux_engine_mixed_batch_equals_solo_either_way(tiny_flux_dev_dir, one_torch_thread, length_groups):
    """Through the engine (true CFG rows): Flux requests of three sizes in one step batch each
    equal their solo run, with and without `EngineConfig.length_groups`; the double block's
    attention runs once per token count (32x64 and 64x32 share one) or once over the padded rows."""
    _mixed_engine_batch_equals_solo(tiny_flux_dev_dir, length_groups, max_sequence_length=32, true_cfg_scale=2.0,
                                    negative_prompt="blur")


def _tiny_qwen(grouped):
    from diffusers import QwenImageTransformer2DModel

    from diffserve.pipelines.qwen_image.mixed_sizes import install_token_spans

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        axes_dims_rope=(4, 6, 6)).eval()
    assert install_token_spans(model, grouped=grouped)
    return model


@pytest.mark.parametrize("edit", [False, True])
def test_qwen_blocks_run_per_size_and_equal_padded_and_solo(edit):
    """Five Qwen-Image rows of three token counts (4x8 and 8x4 latents: one count, own image
    RoPE and own text offset) with texts of three lengths (right-padded, masked), edits with
    references of two sizes after them: every block runs once per (target, reference, text)
    count on real tokens only, no mask, with the forward context narrowed; every row's target
    tokens equal the padded masked forward (switch off) and its solo forward (own text length,
    no mask)."""
    from diffserve.pipelines.qwen_image.mixed_sizes import PATCH, QwenSpans

    switch = {"on": True}
    model = _tiny_qwen(lambda: switch["on"])
    sizes = [(8, 8), (4, 8), (8, 4), (4, 4), (4, 8)]  # latent pixels; 2x2 patches per token
    refs = [(4, 4), (8, 4), (4, 4), (4, 4), (8, 4)] if edit else [None] * 5
    texts = [5, 3, 3, 4, 5]
    tokens = [h * w // PATCH ** 2 for h, w in sizes]
    ref_tokens = [h * w // PATCH ** 2 for h, w in refs] if edit else [0] * 5
    longest, reference, text = max(tokens), max(ref_tokens), max(texts)
    g = torch.Generator().manual_seed(1)
    target = [torch.randn(n, 16, generator=g) for n in tokens]
    ref = [torch.randn(m, 16, generator=g) for m in ref_tokens]
    hidden = torch.zeros(5, longest + reference, 16)
    ctx, mask = torch.zeros(5, text, 32), torch.zeros(5, text, dtype=torch.bool)
    for r in range(5):
        hidden[r, :tokens[r]] = target[r]
        hidden[r, longest:longest + ref_tokens[r]] = ref[r]
        ctx[r, :texts[r]] = torch.randn(texts[r], 32, generator=g)
        mask[r, :texts[r]] = True
    t = torch.tensor([0.9, 0.5, 0.1, 0.7, 0.3])

    def shapes(r):
        grids = [(1, sizes[r][0] // PATCH, sizes[r][1] // PATCH)]
        return grids + [(1, refs[r][0] // PATCH, refs[r][1] // PATCH)] if edit else grids

    data = {LATENT_SIZE: tuple(sizes), IMAGE_TOKENS: tuple(tokens)}
    if edit:
        data.update({REFERENCE_SIZE: tuple(refs), REFERENCE_TOKENS: tuple(ref_tokens)})
    rows = RowData(data, 5)
    spans = QwenSpans(longest, reference)
    seen = []
    model.transformer_blocks[1].attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((tuple(kwargs["hidden_states"].shape[:2]), current_rows().num_rows,
                                                  kwargs["encoder_hidden_states"].shape[1],
                                                  kwargs["encoder_hidden_states_mask"] is not None)),
        with_kwargs=True)

    def forward():
        with torch.no_grad(), forward_rows(rows):
            return model(hidden_states=hidden, encoder_hidden_states=ctx, encoder_hidden_states_mask=mask,
                         timestep=t, img_shapes=[shapes(0)] * 5, attention_kwargs={"spans": spans}).sample

    grouped = forward()
    if edit:  # (n + m, text) = (4 + 4, 4) | (8 + 4, 3) | (8 + 8, 3) | (8 + 8, 5) | (16 + 4, 5)
        assert seen == [((1, 8), 1, 4, False), ((1, 12), 1, 3, False), ((1, 16), 1, 3, False),
                        ((1, 16), 1, 5, False), ((1, 20), 1, 5, False)]
    else:  # (n, text) = (4, 4) | (8, 3): 4x8 and 8x4 | (8, 5) | (16, 5)
        assert seen == [((1, 4), 1, 4, False), ((2, 8), 2, 3, False), ((1, 8), 1, 5, False),
                        ((1, 16), 1, 5, False)]
    switch["on"] = False
    seen.clear()
    padded = forward()
    assert seen == [((5, longest + reference), 5, text, True)]  # one call over the padded rows, masked
    for r, n in enumerate(tokens):
        torch.testing.assert_close(grouped[r, :n], padded[r, :n], atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            solo = model(hidden_states=torch.cat([target[r], ref[r]])[None], timestep=t[r:r + 1],
                         encoder_hidden_states=ctx[r:r + 1, :texts[r]], img_shapes=[shapes(r)]).sample
        torch.testing.assert_close(grouped[r, :n], solo[0, :n], atol=1e-5, rtol=1e-4)


def test_qwen_text_groups_need_prefix_masks():
    """A text mask with a real token after a padded one (never from collation) keeps the
    image-count groups and the mask; prefix masks split groups by text length."""
    from diffserve.pipelines.qwen_image.mixed_sizes import text_groups

    with forward_rows(RowData({IMAGE_TOKENS: (4, 2, 2)}, 3)):
        groups = lg.length_groups(4, CPU)
        prefix = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
        assert [(g.members, t) for g, t in text_groups(groups, prefix, 3)] == [((2,), 2), ((1,), 3), ((0,), 2)]
        assert [(g.members, t) for g, t in text_groups(groups, None, 3)] == [((1, 2), 3), ((0,), 3)]
    with forward_rows(RowData({IMAGE_TOKENS: (4, 2, 2)}, 3)):
        holes = torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
        assert text_groups(lg.length_groups(4, CPU), holes, 3) is None


@pytest.mark.parametrize("length_groups", [True, False])
def test_qwen_engine_mixed_batch_equals_solo_either_way(tiny_qwen_image_dir, one_torch_thread, length_groups):
    """Through the engine (true CFG rows, texts of different lengths): Qwen-Image requests of
    three sizes in one step batch each equal their solo run, with and without
    `EngineConfig.length_groups`; a block's attention runs per (token count, text length) on
    real tokens without a mask, or once over the padded rows with one."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_dir), max_batch_size=8,
                                          length_groups=length_groups))
    assert engine.runner.adapter.length_groups is length_groups
    assert engine.model_info.padding_free is length_groups  # the scheduler counts real tokens
    prompts = ["a red kite", "snow", "a blue boat on a quiet lake"]
    params = [SamplingParams(num_inference_steps=3, seed=10 + i, height=h, width=w, output_type="np",
                             true_cfg_scale=2.0, negative_prompt="blur")
              for i, (h, w) in enumerate([(64, 64), (32, 64), (64, 32)])]
    calls = []
    attn = engine.runner.adapter.pipe.transformer.transformer_blocks[0].attn
    hook = attn.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((*kwargs["hidden_states"].shape[:2],
                                                   kwargs["encoder_hidden_states_mask"] is not None)),
        with_kwargs=True)
    batched = engine.generate(prompts, params)
    hook.remove()
    stats = engine.stats()["scheduler"]
    assert stats["mean_rows_per_forward"] == 6  # three sizes x true CFG in every forward
    if length_groups:  # 64x64 | 32x64 + 64x32 (the negatives share a length), real tokens only
        assert {n for _, n, _ in calls} == {8, 16} and not any(masked for *_, masked in calls)
        assert sum(g for g, _, _ in calls) == 6 * stats["forwards"]
    else:
        assert calls == [(6, 16, True)] * stats["forwards"]
    for prompt, p, out in zip(prompts, params, batched):
        assert out.ok, out.error
        [solo] = engine.generate([prompt], [p])
        assert float(np.abs(out.images - solo.images).max()) <= 1e-4


def test_qwen_edit_engine_groups_by_target_and_reference(tiny_qwen_image_edit_dir, one_torch_thread):
    """Qwen-Image-Edit through the engine: inputs of two aspect ratios (reference token counts)
    and two output sizes in one forward run each block per (target, reference) pair, and each
    request equals its solo run."""
    from PIL import Image

    engine = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_edit_dir), max_batch_size=4))
    assert engine.model_info.padding_free
    images = [Image.new("RGB", (64, 32), (200, 30, 30)), Image.new("RGB", (48, 48), (30, 200, 30))]
    params = [SamplingParams(num_inference_steps=2, seed=i, height=h, width=w, output_type="np")
              for i, (h, w) in enumerate([(64, 64), (32, 64)])]
    calls = []
    attn = engine.runner.adapter.pipe.transformer.transformer_blocks[0].attn
    hook = attn.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    batched = engine.generate(["make it blue", "add snow"], params, inputs=images)
    hook.remove()
    assert [max(o.metrics.batch_sizes) for o in batched] == [2, 2]
    assert calls and set(calls) == {1}  # one row per (target, reference) pair: never the padded pair
    for prompt, p, image, out in zip(["make it blue", "add snow"], params, images, batched):
        assert out.ok, out.error
        [solo] = engine.generate([prompt], [p], inputs=[image])
        assert float(np.abs(out.images - solo.images).max()) <= 1e-4


def test_length_groups_config_and_flag():
    """``EngineConfig.length_groups`` takes true or false only (the error names the field);
    ``--no-length-groups`` turns it off, the default keeps it on."""
    from diffserve.core.errors import InvalidRequestError
    from diffserve.entrypoints.cli_args import build_parser
    from diffserve.entrypoints.engine_args import engine_config_from_args

    with pytest.raises(InvalidRequestError, match="length_groups"):
        EngineConfig(length_groups="yes")

    def config(*flags):
        return engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x", *flags]))

    assert config().length_groups is True
    assert config("--no-length-groups").length_groups is False
