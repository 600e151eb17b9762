"""Wan text-to-video (`WanPipeline`) quirks: latents and more steps on each Wan 2.2 expert equal
diffusers, ``guidance_scale_2`` following ``guidance_scale``, the flow-matching Euler folder,
per-token timesteps, expert-aware batching, non-finite decode, defaults and frame limits,
regional compile of both experts, context folding. On tiny random-weight folders
(tests/tiny_models/wan.py). (Parity, batch invariance, refusals, output types, streams and cache
backends of Wan 2.1, Wan 2.2 and the built-in digits-video: tests/conformance/.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from diffserve import DiffusionEngine, EngineConfig, EventType, InvalidRequestError, SamplingParams
from diffserve.core.errors import NonFiniteOutputError
from diffserve.pipelines.base import RequestState
from seeds import image_generators

TOL = 1e-4
SIZE = dict(height=32, width=48, num_frames=9)  # 3 latent frames of 4x6


def _p(seed, steps=2, guidance=5.0, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=guidance,
                          output_type=kw.pop("output_type", "np"), **SIZE, **kw)


def _engine(folder, **kw) -> DiffusionEngine:
    return DiffusionEngine(EngineConfig(model=str(folder), **{"max_batch_size": 16, **kw}))


def _solo(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


def _finals(engine):
    finals, steps = {}, []
    while engine.has_unfinished_requests():
        events = engine.step()
        steps.append(sorted(e.request_id for e in events if e.type is EventType.PROGRESS))
        finals.update({e.request_id: e.output for e in events if e.type.is_final})
    return finals, [s for s in steps if s]


def _reference(folder, prompt, *, steps, guidance, seed, n=1, negative=None, output_type="np", **kw):
    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, negative_prompt=negative, num_videos_per_prompt=n, num_inference_steps=steps,
                guidance_scale=guidance, generator=image_generators(seed, n),
                output_type=output_type, **SIZE, **kw).frames


@pytest.fixture(scope="module")
def wan(tiny_wan_dir):
    return _engine(tiny_wan_dir)


@pytest.fixture(scope="module")
def wan22(tiny_wan22_dir):
    """No encode/decode side thread: deterministic interleavings for the expert tests."""
    return _engine(tiny_wan22_dir, overlap_stages=False)


@pytest.fixture(scope="module")
def tiny_wan_euler_dir(tiny_wan_dir, tmp_path_factory):
    """The tiny Wan 2.1 folder with a FlowMatchEulerDiscreteScheduler (shift 3): the batched
    flow-matching step path."""
    folder = tmp_path_factory.mktemp("tiny_wan_euler") / "wan"
    shutil.copytree(tiny_wan_dir, folder)
    shutil.rmtree(folder / "scheduler")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(folder / "scheduler")
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


# ------------------------------------------------------------------------------- parity
def _assert_video_parity(video, ref):
    """uint8 (F, H, W, 3) vs diffusers' float frames in [0, 1]: at most one uint8 level."""
    assert video.dtype == np.uint8 and video.shape == ref.shape
    assert np.abs(video.astype(np.float64) / 255 - ref).max() <= 1 / 255


@pytest.mark.parametrize("steps,guidance,n,negative", [(3, 5.0, 1, None)], ids=["cfg-3-steps"])
def test_wan21_matches_diffusers(wan, tiny_wan_dir, steps, guidance, n, negative):
    [out] = wan.generate("a cat runs", _p(7, steps, guidance, num_images_per_prompt=n, negative_prompt=negative))
    ref = _reference(tiny_wan_dir, "a cat runs", steps=steps, guidance=guidance, seed=7, n=n, negative=negative)
    assert out.ok and out.images == [] and len(out.videos) == n
    for video, expected in zip(out.videos, ref):
        _assert_video_parity(video, expected)
    assert out.metrics.batch_sizes == {n * (2 if guidance > 1 else 1): steps}  # one forward per step


def test_wan21_latents_match_diffusers(wan, tiny_wan_dir):
    [out] = wan.generate("a dog", _p(3, steps=3, output_type="latent"))
    ref = _reference(tiny_wan_dir, "a dog", steps=3, guidance=5.0, seed=3, output_type="latent")
    assert out.videos[0].shape == ref[0].shape == (16, 3, 4, 6)
    assert (out.videos[0] - ref[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("guidance,guidance_2", [(5.0, 2.0), (4.0, None)], ids=["cfg-two-scales", "cfg-same-scale"])
def test_wan22_two_experts_match_diffusers(wan22, tiny_wan22_dir, guidance, guidance_2):
    # 4 steps at t = 999, 900, 750, 500: two on each expert (boundary 875)
    [out] = wan22.generate("a red car", _p(5, steps=4, guidance=guidance, guidance_scale_2=guidance_2))
    ref = _reference(tiny_wan22_dir, "a red car", steps=4, guidance=guidance, seed=5, guidance_scale_2=guidance_2)
    _assert_video_parity(out.videos[0], ref[0])
    assert out.params.guidance_scale_2 == (guidance if guidance_2 is None else guidance_2)


def test_flow_match_euler_folder_matches_diffusers_and_steps_batched(tiny_wan_euler_dir):
    engine = _engine(tiny_wan_euler_dir)
    [out] = engine.generate("a boat", _p(4, steps=3))
    _assert_video_parity(out.videos[0], _reference(tiny_wan_euler_dir, "a boat", steps=3, guidance=5.0, seed=4)[0])
    state = RequestState("s", "a boat", _p(4, steps=3).resolve(engine.spec, engine.config.limits))
    engine.runner.adapter.prepare(state)
    assert state.sigmas is not None  # the batched Euler step, not scheduler.step per request
    jobs = [("a boat", _p(4, steps=3, output_type="latent")), ("a tree", _p(8, steps=2, guidance=3.0, output_type="latent"))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert max(outs[1].metrics.batch_sizes) == 4
    for job, batched in zip(jobs, outs):
        assert (batched.videos[0] - _solo(engine, *job).videos[0]).abs().max() <= TOL


def test_per_token_timesteps_match_diffusers(tiny_wan_dir, tmp_path):
    """``expand_timesteps`` (Wan 2.2 TI2V): the transformer gets one timestep per patch token."""
    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    [out] = _engine(folder).generate("a dog", _p(3, steps=3, output_type="latent"))
    ref = _reference(folder, "a dog", steps=3, guidance=5.0, seed=3, output_type="latent")
    assert (out.videos[0] - ref[0]).abs().max() <= 1e-5


# ---------------------------------------------------------------------- batching
def test_wan22_requests_on_different_experts_never_share_a_forward(wan22):
    """A (4 steps: experts 0, 0, 1, 1) and C (2 steps: t = 999 on expert 0, 750 on expert 1)
    start together: they share step 1, A's step 2 (t = 900) runs alone since C has crossed the
    boundary, then both are on the low-noise expert at t = 750 and share again."""
    jobs = {"a": ("a red car", _p(1, steps=4, output_type="latent")),
            "c": ("a blue car", _p(2, steps=2, guidance=3.0, guidance_scale_2=6.0, output_type="latent"))}
    ids = {wan22.add_request(prompt, params): name for name, (prompt, params) in jobs.items()}
    finals, steps = _finals(wan22)
    assert [sorted(ids[r] for r in step) for step in steps] == [["a", "c"], ["a"], ["a", "c"], ["a"]]
    by_name = {ids[r]: out for r, out in finals.items()}
    assert by_name["c"].metrics.batch_sizes == {4: 2}
    assert by_name["a"].metrics.batch_sizes == {4: 2, 2: 2}
    for name, (prompt, params) in jobs.items():
        assert (by_name[name].videos[0] - _solo(wan22, prompt, params).videos[0]).abs().max() <= TOL


def test_wan22_late_request_waits_for_its_expert(wan22):
    first = wan22.add_request("a fox", _p(1, steps=4))
    wan22.step()
    wan22.step()  # first is now on the low-noise expert
    late = wan22.add_request("an owl", _p(2, steps=4))
    finals, steps = _finals(wan22)
    assert steps == [[first], [first], [late], [late], [late], [late]]
    assert all(f.ok for f in finals.values())


def test_adapter_refuses_a_batch_across_experts(wan22):
    adapter = wan22.runner.adapter
    states = []
    for step in (0, 2):
        state = RequestState(f"r{step}", "x", _p(1, steps=4).resolve(wan22.spec, wan22.config.limits))
        adapter.prepare(state)
        state.step_index = step
        states.append(state)
    assert [adapter.step_key(s) for s in states] == [0, 1]
    with pytest.raises(ValueError, match="different experts"):
        adapter.denoise(adapter.collate(states))


# ------------------------------------------------------------------------ outputs
def test_decode_raises_on_non_finite_pixels(wan):
    adapter = wan.runner.adapter
    state = RequestState("nan", "x", _p(1).resolve(wan.spec, wan.config.limits))
    with pytest.raises(NonFiniteOutputError):
        adapter.decode(state, torch.full((1, 16, 3, 4, 6), float("nan")))


def test_spec_defaults_and_size_limits(wan, wan22):
    spec = wan.spec
    assert (spec.default_num_frames, spec.frame_factor, spec.default_fps) == (81, 4, 16)
    assert (spec.default_num_inference_steps, spec.default_guidance_scale, spec.default_max_sequence_length) == \
        (50, 5.0, 512)
    assert spec.resolution_factor == 16 and spec.default_guidance_scale_2 is None
    assert wan22.spec.default_guidance_scale_2 == 5.0
    assert spec.max_num_frames == (32 - 1) * 4 + 1  # the tiny transformer's RoPE length (32)
    for fields, name in [(dict(num_frames=8), "num_frames"), (dict(height=40), "height"),
                         (dict(num_frames=129), "num_frames")]:
        with pytest.raises(InvalidRequestError, match=name):
            wan.add_request("x", SamplingParams(**{**SIZE, **fields}))


# ------------------------------------------------------------------ acceleration
def test_regional_compile_covers_both_experts_without_recompiles(tiny_wan22_dir, tmp_path):
    """Both experts compile (1, 2 and 4 rows, and the warm-up's mixed forward of the default
    request beside one of half its height); a later mixed forward of other sizes and frame
    counts compiles nothing new (a compiled block keeps the padded masked path, not length
    groups) and equals the eager, grouped run."""
    folder = tmp_path / "wan22"
    shutil.copytree(tiny_wan22_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(SIZE))
    engine = _engine(folder, compile=True, max_batch_size=4)
    jobs = [("a", _p(1, steps=4)), ("c", _sized(3, 48, 32, 5, steps=4, output_type="np")),  # a's steps, its experts
            ("b", _p(2, steps=2, guidance=1.0))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert max(outs[1].metrics.batch_sizes) == 4  # "a" and "c": mixed forwards on both experts
    eager = _engine(folder)
    for out, job in zip(outs, jobs):
        assert np.abs(out.videos[0].astype(int) - _solo(eager, *job).videos[0]).max() <= 1
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["recompiles_after_warmup"] == 0, stats
    # compiled blocks take the padded masked path; eager forwards run length groups
    assert not engine.model_info.padding_free and eager.model_info.padding_free


def test_compile_without_generation_config_fits_the_default_size(tiny_wan_dir):
    """A folder without ``generation_config.json`` whose RoPE grid stops at 512 pixels: the
    family default 480x832 is fitted within it (aspect kept, multiples of 16: 288x512), so the
    compile warm-up (which runs the default request) loads and a request without a size runs."""
    assert not (tiny_wan_dir / "generation_config.json").exists()
    engine = _engine(tiny_wan_dir, compile=True, max_batch_size=1)
    spec = engine.runner.adapter.spec
    assert (spec.default_height, spec.default_width, spec.default_num_frames) == (288, 512, 81)
    assert spec.default_width <= spec.max_width == 512
    [out] = engine.generate("a", SamplingParams(seed=1, num_inference_steps=1, guidance_scale=1.0,
                                                 output_type="latent"))
    assert out.ok, out.error
    assert engine.runner.acceleration_stats()["compile"]["recompiles_after_warmup"] == 0


# ---------------------------------------------------------------- context folding
@pytest.mark.parametrize("folder", ["tiny_wan_dir", "tiny_wan22_dir"], ids=["wan21", "wan22"])
def test_context_folding_matches_the_full_context(folder, request):
    """Folded padding rows (one row + a log-count attention bias) give the full 512-row
    result: co-batched prompts of different lengths, a negative prompt, a budget short enough
    that a prompt fills it (nothing to fold), on one expert and on two."""
    folder = request.getfixturevalue(folder)
    jobs = [("a lighthouse on a cliff at night", _p(1, steps=3, output_type="latent")),
            ("fox", _p(2, steps=3, guidance=3.0, negative_prompt="blurry, dark", output_type="latent")),
            ("a bowl of fruit", _p(3, steps=2, guidance=1.0, output_type="latent")),
            ("a very long prompt over eight", _p(4, steps=2, max_sequence_length=8, output_type="latent")),
            ("cat", _p(5, steps=2, max_sequence_length=8, output_type="latent"))]
    folded = _engine(folder, overlap_stages=False)
    full = _engine(folder, overlap_stages=False, context_folding=False)
    assert folded.runner.adapter.context_folding and not full.runner.adapter.context_folding
    assert folded.runner.acceleration_stats()["context_folding"] == {"enabled": True}
    prompts, params = [j[0] for j in jobs], [j[1] for j in jobs]
    for a, b in zip(folded.generate(prompts, params), full.generate(prompts, params)):
        assert a.ok and b.ok
        assert (a.videos[0] - b.videos[0]).abs().max() <= 1e-5


def test_context_folding_shortens_the_context_and_leaves_stock_modules(wan):
    """A batch's context is its longest prompt plus one row (not 512); outside the adapter's
    forwards the shared transformer computes stock diffusers."""
    adapter = wan.runner.adapter
    states = []
    for k, prompt in enumerate(["a red car", "a lighthouse on a cliff"]):
        state = RequestState(f"r{k}", prompt, _p(k).resolve(wan.spec, wan.config.limits))
        adapter.prepare(state)
        states.append(state)
    tokens = [len(adapter.pipe.tokenizer(s.prompt).input_ids) for s in states]
    assert [s.branches[1]["encoder_hidden_states"].shape[1] for s in states] == [n + 1 for n in tokens]
    batch = adapter.collate(states)
    assert batch.inputs["encoder_hidden_states"].shape[1] == max(tokens) + 1
    assert batch.row_data.uniform("folded_context_length") == 512  # the rows the folded context stands for
    adapter.denoise(batch)
    processors = [block.attn2.processor for block in adapter.pipe.transformer.blocks]
    assert all(p.max_sequence_length is None for p in processors)  # the count comes from the forward context


def test_fold_padding_rows_keeps_one_zero_row():
    from diffserve.pipelines.wan.context_folding import append_folded_row, fold_padding_rows

    embeds = torch.zeros(2, 16, 4)
    embeds[0, :3] = 1.0
    embeds[1, :5] = 2.0
    assert fold_padding_rows(embeds).shape == (2, 6, 4)
    assert torch.equal(fold_padding_rows(embeds), embeds[:, :6])
    assert fold_padding_rows(torch.ones(1, 16, 4)).shape == (1, 16, 4)  # nothing padded: all kept
    assert fold_padding_rows(torch.zeros(1, 16, 4)).shape == (1, 1, 4)
    folded = append_folded_row(embeds[:, :5], 16)
    assert folded.shape == (2, 6, 4) and not folded[:, 5].any()
    with pytest.raises(ValueError, match="no padding"):
        append_folded_row(embeds, 16)


# ------------------------------------------------------------------ mixed sizes
def _sized(seed, height, width, frames, steps=2, guidance=5.0, **kw):
    return SamplingParams(seed=seed, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                          guidance_scale=guidance, output_type=kw.pop("output_type", "latent"), **kw)


#: sizes and frame counts that pad every axis: (32x48, 5 frames) is the widest, (48x32, 9) the
#: tallest and longest, (16x16, 1) the smallest
MIXED = [("a lighthouse on a cliff at night", _sized(1, 32, 48, 5, steps=3)),
         ("fox", _sized(2, 48, 32, 9, guidance=3.0, negative_prompt="blurry")),
         ("a bowl of fruit", _sized(3, 16, 16, 1, guidance=4.0))]


def _mixed_vs_alone(engine) -> list[float]:
    together = engine.generate([j[0] for j in MIXED], [j[1] for j in MIXED])
    assert max(together[0].metrics.batch_sizes) == 6, together[0].metrics.batch_sizes  # 3 requests x 2 CFG rows
    return [float((t.videos[0] - _solo(engine, *job).videos[0]).abs().max()) for t, job in zip(together, MIXED)]


def test_mixed_sizes_and_frame_counts_need_the_key_mask(tiny_wan_dir, monkeypatch):
    """Rows of different sizes AND frame counts share one forward and each equals its solo run;
    without the self-attention key mask (`wan.mixed_sizes.key_mask`) the padded tokens leak
    into the real ones."""
    from diffserve.pipelines.wan import mixed_sizes

    engine = _engine(tiny_wan_dir, overlap_stages=False)
    assert engine.runner.adapter.mixed_sizes
    assert max(_mixed_vs_alone(engine)) <= TOL
    monkeypatch.setattr(mixed_sizes, "key_mask", lambda *args, **kwargs: None)
    assert max(_mixed_vs_alone(engine)) > 1e-3  # the test sees a missing mask


def test_mixed_sizes_keep_padded_latents_zero(wan):
    """The guided prediction is zero outside each request's region (`zero_outside`), so the
    batch's padded latents stay zero through the batched steps."""
    adapter = wan.runner.adapter
    states = []
    for k, (prompt, params) in enumerate(MIXED):
        state = RequestState(f"r{k}", prompt, params.resolve(wan.model_info.spec, wan.config.limits, 0))
        adapter.prepare(state)
        states.append(state)
    batch = adapter.collate(states)
    guided = adapter.combine(batch, adapter.denoise(batch))
    assert tuple(guided.shape[2:]) == (3, 6, 6)  # the largest of each axis: frames, height, width
    for full, state in zip(guided.split(batch.row_counts), states):
        f, h, w = state.latents.shape[2:]
        region = torch.zeros_like(full, dtype=torch.bool)
        region[:, :, :f, :h, :w] = True
        assert full[~region].abs().max() == 0 and full[region].abs().min() > 0


def test_no_mixed_sizes_batches_wan_by_size_and_frames(tiny_wan_dir):
    """``mixed_sizes=False``: sizes and frame counts split batches again."""
    engine = _engine(tiny_wan_dir, mixed_sizes=False)
    outs = engine.generate([j[0] for j in MIXED], [j[1] for j in MIXED])
    assert [max(o.metrics.batch_sizes) for o in outs] == [2, 2, 2]


def test_mixed_sizes_under_teacache_follow_the_computed_rows(tiny_wan_dir, monkeypatch):
    """Under TeaCache one request computes its blocks while the other reuses its residual: the
    key mask follows the computed rows (`WanTeaCacheSplit.select_rows`), and each request
    equals its run alone."""
    from diffserve.acceleration import teacache

    engine = _engine(tiny_wan_dir, cache_backend="teacache", cache_config={"rel_l1_thresh": 1e9},
                     overlap_stages=False)  # (the random tiny model's rescaled changes are huge)
    small = _sized(1, 32, 32, 5, steps=4)
    large = _sized(2, 48, 48, 9, steps=8, guidance=3.0)  # the widest on every axis: its layout holds
    subsets = []
    narrowed_rows = teacache.narrowed_rows
    monkeypatch.setattr(teacache, "narrowed_rows", lambda index: subsets.append(list(index)) or narrowed_rows(index))
    together = engine.generate(["a cat", "a dog"], [small, large])
    monkeypatch.setattr(teacache, "narrowed_rows", narrowed_rows)
    assert max(together[0].metrics.batch_sizes) == 4
    assert subsets and all(len(rows) == 2 for rows in subsets)  # one request's two CFG rows computed alone
    for t, job in zip(together, [("a cat", small), ("a dog", large)]):
        assert (t.videos[0] - _solo(engine, *job).videos[0]).abs().max() <= TOL


# ------------------------------------------------------------------ length groups
def _grid_rows(sizes, grid, seed):
    """(B, 4, *grid) latents, each row's own (F, h, w) region random and the rest zero."""
    torch.manual_seed(seed)
    latents = torch.zeros(len(sizes), 4, *grid)
    for r, (f, h, w) in enumerate(sizes):
        latents[r, :, :f, :h, :w] = torch.randn(4, f, h, w)
    return latents


@pytest.mark.parametrize("per_token", [False, True], ids=["timestep", "per_token_timesteps"])
def test_blocks_run_per_size_on_real_tokens_and_equal_padded_and_solo(per_token, always_group):
    """Four rows of three sizes and frame counts: each block runs once per size on that size's
    real tokens, a 3-D box of the padded grid (`wan.mixed_sizes.size_groups`), and the output
    equals the padded masked forward (switch off) on every row's region and each row's solo
    forward; also with per-token timesteps (Wan 2.2 TI2V: temb (B, N, 6, D) gathered per
    token)."""
    from diffusers import WanTransformer3DModel

    from diffserve.pipelines.row_data import RowData, current_rows, forward_rows
    from diffserve.pipelines.token_spans import LATENT_SIZE
    from diffserve.pipelines.wan.mixed_sizes import install_token_spans

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                  rope_max_seq_len=16).eval()
    switch = {"on": True}
    install_token_spans(model, lambda: switch["on"])
    sizes, grid = [(3, 6, 4), (2, 4, 6), (3, 6, 4), (1, 2, 2)], (3, 6, 6)  # every axis padded somewhere
    latents = _grid_rows(sizes, grid, seed=1)
    ctx = torch.randn(4, 5, 16)
    if per_token:  # a timestep per patch token of the padded grid (3 x 3 x 3)
        timestep = (torch.rand(4, 3, 3, 3) * 1000).round()
        solo_t = [timestep[r:r + 1, :f, :h // 2, :w // 2].reshape(1, -1) for r, (f, h, w) in enumerate(sizes)]
        timestep = timestep.reshape(4, -1)
    else:
        timestep = torch.tensor([900.0, 500.0, 100.0, 700.0])
        solo_t = [timestep[r:r + 1] for r in range(4)]
    rows = RowData({LATENT_SIZE: tuple(sizes)}, 4)
    seen = []
    hook = model.blocks[0].attn1.register_forward_pre_hook(
        lambda module, args: seen.append((tuple(args[0].shape[:2]), current_rows().num_rows)))

    def forward():
        with torch.no_grad(), forward_rows(rows):
            return model(hidden_states=latents, timestep=timestep, encoder_hidden_states=ctx).sample

    grouped = forward()
    assert seen == [((2, 18), 2), ((1, 12), 1), ((1, 1), 1)]  # (3, 6, 4) x2 | (2, 4, 6) | (1, 2, 2)
    switch["on"] = False
    seen.clear()
    padded = forward()
    assert seen == [((4, 27), 4)]  # one call over the padded grid, with the key mask
    hook.remove()
    for r, (f, h, w) in enumerate(sizes):
        region = (slice(r, r + 1), slice(None), slice(0, f), slice(0, h), slice(0, w))
        torch.testing.assert_close(grouped[region], padded[region], atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            solo = model(hidden_states=latents[region], timestep=solo_t[r], encoder_hidden_states=ctx[r:r + 1]).sample
        torch.testing.assert_close(grouped[region], solo, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length_groups", [True, False])
def test_engine_length_groups_switch(tiny_wan_dir, length_groups, always_group):
    """Through the engine (CFG rows, context folding): requests of three sizes and frame counts
    share forwards and equal their runs alone either way; with `EngineConfig.length_groups`
    every self-attention sees one size's real tokens only and `ModelInfo.padding_free` says
    so, without it the mixed forwards run over the padded grid."""
    engine = _engine(tiny_wan_dir, overlap_stages=False, length_groups=length_groups)
    adapter = engine.runner.adapter
    assert adapter.length_groups is length_groups
    assert engine.model_info.padding_free is length_groups
    seen = []
    hook = adapter.pipe.transformer.blocks[0].attn1.register_forward_pre_hook(
        lambda module, args: seen.append(tuple(args[0].shape[:2])))
    together = engine.generate([j[0] for j in MIXED], [j[1] for j in MIXED])
    hook.remove()
    assert max(together[0].metrics.batch_sizes) == 6  # 3 requests x 2 CFG rows
    for t, job in zip(together, MIXED):
        assert (t.videos[0] - _solo(engine, *job).videos[0]).abs().max() <= TOL
    # real tokens: (2, 4, 6) latents -> 2 x 2 x 3 patches, (3, 6, 4) -> 18, (1, 2, 2) -> 1; the
    # padded grid (3, 6, 6) -> 27
    if length_groups:  # each size's two CFG rows on its real tokens, never the padded grid
        assert {(2, 12), (2, 18), (2, 1)} <= set(seen) and all(n != 27 for _, n in seen), seen
    else:
        assert (6, 27) in seen and (2, 18) not in seen, seen


@pytest.mark.parametrize("model", ["tiny", "digits-video"])
def test_stream_chunks_beside_a_request_of_another_size(model, request):
    """A two-chunk stream shares forwards with a request of another size and frame count; both
    equal their runs alone. On the built-in video model (``expand_timesteps``) the second
    chunk's clean first frame gets timestep-0 tokens on the padded grid."""
    if model == "tiny":
        engine = request.getfixturevalue("wan")
        sizes = [(32, 48, 5), (48, 32, 9)]
    else:
        engine = _engine("digits-video", overlap_stages=False)
        sizes = [(16, 16, 5), (16, 16, 9)]
    stream = _sized(4, *sizes[0], steps=3, num_chunks=2, output_type="np")
    other = _sized(5, *sizes[1], steps=5, guidance=3.0, output_type="np")
    together = engine.generate(["a cat surfing", "a dog"], [stream, other])
    assert max(together[1].metrics.batch_sizes) == 4
    for t, job in zip(together, [("a cat surfing", stream), ("a dog", other)]):
        alone = _solo(engine, *job)
        assert t.videos[0].shape == alone.videos[0].shape
        assert np.abs(t.videos[0].astype(int) - alone.videos[0]).max() <= 1
    if model != "tiny":
        assert engine.runner.adapter.expand_timesteps
