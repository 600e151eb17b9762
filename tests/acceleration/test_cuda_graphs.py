"""CUDA graphs of the denoiser forward (`diffserve.acceleration.cuda_graphs`): replays equal the
eager forwards, a batch padded up to its row bucket gives its own rows unchanged, and graphs
compose with the step batching of requests at different steps.

These need a CUDA device and are skipped without one (CPU CI); on a device machine they run
with the rest of the suite (`python -m pytest tests/acceleration/test_cuda_graphs.py`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

#: fp32 on the GPU: graph replay runs the very kernels of the eager forward
TOL = 1e-5


def _engines(model_dir, **kw):
    common = dict(model=str(model_dir), device="cuda", dtype="fp32", max_batch_size=8, overlap_stages=False, **kw)
    return DiffusionEngine(EngineConfig(**common)), DiffusionEngine(EngineConfig(cuda_graphs=True, **common))


def _p(seed, steps, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=4.0, output_type="np", **kw)


def test_graph_replays_equal_eager_forwards_at_padded_buckets(tiny_sd3_dir):
    eager, graphs = _engines(tiny_sd3_dir)
    # 3 requests x 2 CFG rows = 6 rows -> bucket 8 (2 padded rows); then 2 requests (4 rows, no
    # padding), then 1 (2 rows): three buckets, requests at different steps in one forward
    jobs = [("a red house", _p(1, 6)), ("a green tree", _p(2, 4)), ("a blue boat", _p(3, 2))]
    expected = eager.generate([p for p, _ in jobs], [q for _, q in jobs])
    before = graphs.runner.acceleration_stats()["cuda_graphs"]
    got = graphs.generate([p for p, _ in jobs], [q for _, q in jobs])
    for a, b in zip(expected, got):
        assert a.ok and b.ok, (a.error, b.error)
        assert np.abs(a.images - b.images).max() <= TOL
    stats = graphs.runner.acceleration_stats()["cuda_graphs"]
    assert stats["replays"] - before["replays"] == 6 and stats["eager"] == before["eager"]  # every step replayed
    assert 1 <= stats["captures"] <= before["captures"] + 3
    assert sorted(set(got[0].metrics.batch_sizes)) == [2, 4, 6]
    again = graphs.generate([p for p, _ in jobs], [q for _, q in jobs])  # replayed, no new capture
    assert graphs.runner.acceleration_stats()["cuda_graphs"]["captures"] == stats["captures"]
    for a, b in zip(got, again):
        np.testing.assert_array_equal(a.images, b.images)


def test_batches_above_the_largest_bucket_run_eagerly(tiny_sd3_dir):
    eager, graphs = _engines(tiny_sd3_dir)
    graphs.runner.accelerator.graphs.buckets = [1, 2]  # a 4-row batch exceeds them
    before = graphs.runner.acceleration_stats()["cuda_graphs"]["eager"]
    jobs = [("a cat", _p(4, 2)), ("a dog", _p(5, 2))]
    for a, b in zip(eager.generate([p for p, _ in jobs], [q for _, q in jobs]),
                    graphs.generate([p for p, _ in jobs], [q for _, q in jobs])):
        assert np.abs(a.images - b.images).max() <= TOL
    assert graphs.runner.acceleration_stats()["cuda_graphs"]["eager"] - before == 2


def test_cuda_graphs_refuse_a_cache_backend(tiny_sd3_dir):
    with pytest.raises(InvalidRequestError, match="cuda_graphs"):
        DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), device="cuda", cuda_graphs=True, cache_backend="teacache"))


def test_graphs_are_keyed_by_the_forwards_row_data(tiny_wan_dir):
    """Wan with context folding reads each request's text length from the forward's row data
    (not an argument): the same prompt with two ``max_sequence_length`` values has the same
    arguments but gets a graph for each length, and every replay equals the eager forward."""
    eager, graphs = _engines(tiny_wan_dir)
    assert graphs.runner.adapter.context_folding

    def params(seed, length):
        return SamplingParams(seed=seed, num_inference_steps=2, guidance_scale=4.0, height=32, width=48,
                              num_frames=5, max_sequence_length=length, output_type="latent")

    jobs = [("a red car", params(1, 16)), ("a red car", params(1, 32))]
    for a, b in zip(eager.generate([p for p, _ in jobs], [q for _, q in jobs]),
                    graphs.generate([p for p, _ in jobs], [q for _, q in jobs])):
        assert a.ok and b.ok, (a.error, b.error)
        assert (a.videos[0] - b.videos[0]).abs().max() <= TOL
    stats = graphs.runner.acceleration_stats()["cuda_graphs"]
    assert stats["captures"] >= 2 and stats["eager"] == 0


def test_mixed_sizes_and_frame_counts_replay_their_masks(tiny_wan_dir):
    """Wan rows of different sizes and frame counts in one captured forward: the key mask the
    capture read from the row data's memo stays alive for the replays (each equals eager)."""
    eager, graphs = _engines(tiny_wan_dir)

    def params(seed, height, width, frames, steps):
        return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=4.0, height=height, width=width,
                              num_frames=frames, output_type="latent")

    jobs = [("a red car", params(1, 32, 48, 5, 4)), ("a boat", params(2, 48, 32, 9, 3))]
    for a, b in zip(eager.generate([p for p, _ in jobs], [q for _, q in jobs]),
                    graphs.generate([p for p, _ in jobs], [q for _, q in jobs])):
        assert a.ok and b.ok, (a.error, b.error)
        assert max(b.metrics.batch_sizes) == 4
        assert (a.videos[0] - b.videos[0]).abs().max() <= TOL
    assert graphs.runner.acceleration_stats()["cuda_graphs"]["replays"] >= 4
