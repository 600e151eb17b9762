"""Mixed sizes in one forward (`diffserve.pipelines.token_spans`): the strip layout, SD3 with
T5 (the span-aware joint attention without context folding) and the cache backends' forward
splits on rows of different sizes. (Every family declaring mixed sizes is also held to it by
``tests/conformance/test_batching.py::test_mixed_sizes_share_a_forward``.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.pipelines.row_data import RowData, forward_rows
from diffserve.pipelines.token_spans import (
    IMAGE_TOKENS,
    REFERENCE_TOKENS,
    TokenLayout,
    attention_bias,
    image_key_mask,
    key_padding_mask,
    zero_padded_tokens,
)

PROMPTS = ("a lighthouse at dusk", "a bowl of fruit on a marble kitchen counter", "snow", "a red kite")


def test_strip_round_trip_keeps_each_rows_region():
    """`to_strip` puts each row's patches in raster order (the order its solo patch embedding
    reads them); `from_strip` puts them back, zeros outside the row's own region."""
    sizes = [(4, 6), (2, 2), (6, 4)]
    layout = TokenLayout(sizes, (6, 6), patch=2)
    assert layout.tokens == [6, 1, 6] and layout.longest == 6
    x = torch.randn(3, 2, 6, 6)
    strip = layout.to_strip(x)
    assert strip.shape == (3, 2, 2, 12)
    for r, (h, w) in enumerate(sizes):
        solo = x[r, :, :h, :w]  # (C, h, w) -> its patches in raster order, one patch tall
        patches = solo.reshape(2, h // 2, 2, w // 2, 2).permute(0, 2, 1, 3, 4).reshape(2, 2, -1)
        assert torch.equal(strip[r, :, :, : patches.shape[-1]], patches)
    back = layout.from_strip(strip)
    for r, (h, w) in enumerate(sizes):
        assert torch.equal(back[r, :, :h, :w], x[r, :, :h, :w])
        outside = back[r].clone()
        outside[:, :h, :w] = 0
        assert not outside.any()  # zeros elsewhere


def test_attention_bias_masks_only_padded_image_keys():
    rows = RowData({IMAGE_TOKENS: (3, 1, 3)}, 3)
    assert key_padding_mask(3, torch.device("cpu")) is None  # outside a forward: stock attention
    with forward_rows(rows):
        bias = attention_bias(3, 5, torch.float32, torch.device("cpu"), fold_count=4)
        assert bias.shape == (3, 1, 1, 5)
        assert torch.isinf(bias[1, 0, 0, 1:3]).all() and not torch.isinf(bias[[0, 2]]).any()
        assert torch.allclose(bias[:, 0, 0, -1], torch.full((3,), float(np.log(4))))
        assert attention_bias(3, 5, torch.float32, torch.device("cpu"), fold_count=4) is bias  # memoised
    with forward_rows(RowData({IMAGE_TOKENS: (3, 3)}, 2)):
        assert attention_bias(3, 5, torch.float32, torch.device("cpu")) is None  # nothing padded


@pytest.mark.parametrize("noisy,reference,expected", [
    ((3, 1), (2, 2), [[1, 1, 1, 1, 1], [1, 0, 0, 1, 1]]),  # only the noisy segment padded
    ((3, 3), (2, 1), [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),  # only the reference segment padded
    ((2, 3), (1, 2), [[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]]),  # both
])
def test_image_key_mask_spans_both_segments(noisy, reference, expected):
    """An edit's image keys are ``[noisy (L_max) | reference (R_max)]``: once either segment is
    padded the mask covers both (True on the segment nobody pads), and zero_padded_tokens
    zeroes exactly the padded tokens of both, keeping what follows."""
    cpu = torch.device("cpu")
    with forward_rows(RowData({IMAGE_TOKENS: noisy, REFERENCE_TOKENS: reference}, 2)):
        mask = image_key_mask(3, 2, cpu)
        assert mask.int().tolist() == expected
        x = torch.ones(2, 6, 1)
        assert zero_padded_tokens(x, 3, reference=2)[..., 0].int().tolist() == [row + [1] for row in expected]
    with forward_rows(RowData({IMAGE_TOKENS: (3, 3), REFERENCE_TOKENS: (2, 2)}, 2)):
        assert image_key_mask(3, 2, cpu) is None


def _mixed_vs_solo(engine, jobs, tol=1e-4):
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    for (prompt, params), out in zip(jobs, outs):
        assert out.ok, out.error
        assert out.images.shape[1:3] == (params.height, params.width)
        [solo] = engine.generate([prompt], [params])
        diff = float(np.abs(out.images - solo.images).max())
        assert diff <= tol, f"{params.height}x{params.width}: batched vs solo differ by {diff}"
    return outs


def test_sd3_with_t5_mixed_sizes_equal_solo(tiny_sd3_t5_dir, one_torch_thread):
    """Without context folding (a T5 folder) the joint attention is `SpanJointAttnProcessor`."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_t5_dir), max_batch_size=16))
    try:
        sizes = ((64, 64), (32, 48), (48, 32))
        jobs = [(PROMPTS[k], SamplingParams(height=h, width=w, num_inference_steps=2 + k % 2, seed=7 + k,
                                            guidance_scale=3.0 + k, max_sequence_length=16, output_type="np"))
                for k, (h, w) in enumerate(sizes)]
        outs = _mixed_vs_solo(engine, jobs)
        assert max(outs[0].metrics.batch_sizes) == 6, outs[0].metrics.batch_sizes
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend,options", [
    ("teacache", {"rel_l1_thresh": 1e9}),
    ("cache_dit", {"Fn_compute_blocks": 1, "residual_diff_threshold": 1e9, "max_warmup_steps": 2}),
])
def test_cache_backends_run_mixed_sizes(backend, options, one_torch_thread):
    """The cache backends' own forwards on requests of different sizes: TeaCache's forward split
    on one forward of mixed rows (2-step requests compute every step, so batched equals solo);
    cache-dit, which runs each request's rows alone, on them one after another."""
    engine = DiffusionEngine(EngineConfig(model="digits", cache_backend=backend, cache_config=options))
    try:
        sizes = ((8, 8), (4, 8), (6, 4))
        jobs = [(f"a handwritten digit {k}", SamplingParams(height=h, width=w, num_inference_steps=2, seed=k,
                                                            guidance_scale=2.0 + k, output_type="np"))
                for k, (h, w) in enumerate(sizes)]
        outs = _mixed_vs_solo(engine, jobs)
        if backend == "teacache":  # cache-dit runs each request's rows in a forward of its own
            assert max(outs[0].metrics.batch_sizes) == 6, outs[0].metrics.batch_sizes
    finally:
        engine.shutdown()


@pytest.mark.parametrize("cache_quality", ["fast", "high"])
def test_teacache_request_whose_batch_changes_layout(cache_quality, one_torch_thread):
    """A TeaCache request that has cached steps and then shares forwards with a request of
    another size (its rows move from their own grid into a strip, and back when the other
    leaves) computes that step and keeps caching in the new layout, instead of failing on a
    forecast of the old layout's shape (the HTTP server's 500 on concurrent mixed sizes)."""
    engine = DiffusionEngine(EngineConfig(model="digits", cache_backend="teacache"))
    try:
        params = dict(num_inference_steps=12, cache_quality=cache_quality, output_type="np")
        first = engine.add_request("a handwritten digit 3", SamplingParams(height=8, width=8, seed=0, **params))
        outputs = {}
        for step in range(40):
            if step == 6:  # `first` has skipped steps by now: its forecasts are of its own 8x8 grid
                engine.add_request("a handwritten digit 4", SamplingParams(height=4, width=8, seed=1,
                                                                           num_inference_steps=3,
                                                                           cache_quality=cache_quality,
                                                                           output_type="np"))
            outputs.update({e.request_id: e.output for e in engine.step() if e.output is not None})
            if len(outputs) == 2 and not engine.has_unfinished_requests():
                break
        assert [o.status.value for o in outputs.values()] == ["finished", "finished"], \
            [o.error for o in outputs.values()]
        assert max(outputs[first].metrics.batch_sizes) == 4  # the two shared forwards
        assert outputs[first].metrics.as_dict()["cache_skipped_steps"] > 0
        assert all(np.isfinite(o.images).all() for o in outputs.values())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("cache_quality,config", [("high", None), ("custom", {"rel_l1_thresh": 0.6})])
def test_teacache_guard_and_trip_wire_see_only_real_tokens(cache_quality, config, one_torch_thread):
    """A small request sharing every forward with a larger one (its rows padded in SD3's strip)
    measures what its solo run measures: the guard's estimate (relative means of the output and
    forecast) and TeaCache's relative input change are taken over its real tokens, not the
    padded patches' values (which made a 4x4 `high` image's estimate 0.045 beside an 8x8
    request, 0.036 alone, and moved its skips)."""
    engine = DiffusionEngine(EngineConfig(model="digits", cache_backend="teacache", cache_config=config or {}))
    try:
        quality = None if cache_quality == "custom" else cache_quality
        small = ("a handwritten digit 5", SamplingParams(height=4, width=4, seed=5, cache_quality=quality,
                                                         output_type="np"))
        large = ("a handwritten digit 4", SamplingParams(height=8, width=8, seed=4, cache_quality="max",
                                                         output_type="np"))
        solo = engine.generate([small[0]], [small[1]])[0]
        mixed = engine.generate([small[0], large[0]], [small[1], large[1]])[0]
        assert max(mixed.metrics.batch_sizes) == 4, mixed.metrics.batch_sizes  # one shared forward
        alone, shared = solo.metrics.as_dict(), mixed.metrics.as_dict()
        assert alone["cache_skipped_steps"] > 0
        assert shared["cache_skipped_steps"] == alone["cache_skipped_steps"]
        if cache_quality != "custom":
            assert shared["cache_error_estimate"] == pytest.approx(alone["cache_error_estimate"], rel=1e-3)
        np.testing.assert_allclose(mixed.images, solo.images, atol=1e-4)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("folder,frames,rows,target", [
    ("tiny_flux_dev_dir", {}, 2, "output"), ("tiny_qwen_image_dir", {}, 2, "output"),
    ("tiny_wan_dir", {"num_frames": 1}, 4, "output"), ("tiny_wan_dir", {"num_frames": 1}, 4, "residual")])
def test_teacache_guard_sees_only_real_tokens_of_other_families(folder, frames, rows, target, request,
                                                                 one_torch_thread):
    """Flux and Qwen-Image (right-padded token sequences) and Wan (padded video grids): a small
    `high` request beside a larger one has its solo run's guard estimate (it was 0.042 vs 0.012
    alone on the tiny Flux; Wan, 1 frame beside 5: 0.0324 vs 0.0306 before the head zeroed the
    padding), also when its level forecasts the blocks' residual (Wan: the embedded input and
    the blocks' output are zero on padded tokens)."""
    levels = {"high": {"target": target}}
    engine = DiffusionEngine(EngineConfig(model=str(request.getfixturevalue(folder)), cache_backend="teacache",
                                          cache_config={"levels": levels}, overlap_stages=False))
    try:
        small = ("a cat", SamplingParams(seed=1, num_inference_steps=12, height=32, width=32, cache_quality="high",
                                         output_type="np", **frames))
        large = ("a dog", SamplingParams(seed=2, num_inference_steps=12, height=64, width=48, cache_quality="max",
                                         output_type="np", **({"num_frames": 5} if frames else {})))
        solo = engine.generate([small[0]], [small[1]])[0]
        mixed = engine.generate([small[0], large[0]], [small[1], large[1]])[0]
        assert max(mixed.metrics.batch_sizes) == rows, mixed.metrics.batch_sizes  # one shared forward
        alone, shared = solo.metrics.as_dict(), mixed.metrics.as_dict()
        assert alone["cache_skipped_steps"] > 0 and shared["cache_skipped_steps"] == alone["cache_skipped_steps"]
        assert shared["cache_error_estimate"] == pytest.approx(alone["cache_error_estimate"], rel=1e-3)
        if not frames:
            np.testing.assert_allclose(mixed.images, solo.images, atol=1e-4)
    finally:
        engine.shutdown()


def test_no_mixed_sizes_batches_by_size(one_torch_thread):
    """``EngineConfig(mixed_sizes=False)`` (``--no-mixed-sizes``): sizes split batches again."""
    engine = DiffusionEngine(EngineConfig(model="digits", mixed_sizes=False))
    try:
        outs = engine.generate(["a 1", "a 2"], [SamplingParams(height=8, width=8, num_inference_steps=2, seed=1),
                                                SamplingParams(height=4, width=8, num_inference_steps=2, seed=2)])
        assert [max(o.metrics.batch_sizes) for o in outs] == [2, 2]
    finally:
        engine.shutdown()
