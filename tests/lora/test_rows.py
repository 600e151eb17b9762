"""Per-row LoRA math (`diffserve.lora.rows`) and the slot pool (`diffserve.lora.pool`) on the tiny
SD3 transformer and SD 1.5 UNet: a mixed batch equals each row run alone under diffusers'
``set_adapters``; slots, pins and eviction. (No recompiles under ``torch.compile``: the engine's
test in test_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusion3Pipeline, StableDiffusionPipeline
from tiny_models.loras import diffusers_reference, random_lora, save_diffusers_lora

from diffserve.core.errors import LoraInUseError
from diffserve.lora.pool import LoraPool, LoraSlotsFullError
from diffserve.lora.reading import read_lora
from diffserve.lora.rows import MAX_RUNS, LoraPlan, LoraRowsError

ATTN = ("to_q", "to_k", "to_v", "to_out.0")


@pytest.fixture(scope="module")
def sd3(tiny_sd3_dir, tmp_path_factory):
    """The tiny SD3 pipeline and two adapter folders A (rank 4, alpha 8) and B (rank 2, alpha 1)."""
    tmp = tmp_path_factory.mktemp("lora_rows")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, text_encoder_3=None, tokenizer_3=None)
    a = save_diffusers_lora(StableDiffusion3Pipeline, tmp / "A",
                            {"transformer": (random_lora(pipe.transformer, ATTN + ("ff.net.2",), 4, seed=1, bias=True),
                                             4, 8.0)})
    b = save_diffusers_lora(StableDiffusion3Pipeline, tmp / "B",
                            {"transformer": (random_lora(pipe.transformer, ATTN, 2, seed=2), 2, 1.0)})
    return tiny_sd3_dir, pipe, {"A": a, "B": b}


def sd3_inputs(rows: int):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(rows, 4, 8, 8, generator=g), timestep=torch.rand(rows, generator=g) * 1000,
                encoder_hidden_states=torch.randn(rows, 10, 32, generator=g),
                pooled_projections=torch.randn(rows, 64, generator=g))


def forward(transformer, inputs):
    with torch.inference_mode():
        return transformer(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("max_groups, dense", [(0, False), (0, True), (100, False)],
                         ids=["batched", "batched-dense", "grouped"])
def test_mixed_rows_equal_diffusers_per_row(sd3, max_groups, dense, monkeypatch):
    """One forward with rows using A (with a LoRA bias), B, A+B at other scales, nothing, and A
    again equals diffusers' set_adapters on each row alone: with every LoRA row in two bmm
    (batched; dense: every row exactly one adapter, accumulated in place), and with two matmuls
    per (adapter, scale) group on row slices, or gathered rows when a group's rows form many runs
    (grouped)."""
    from diffserve.lora import rows as rows_module

    monkeypatch.setattr(rows_module, "MAX_GROUPS", max_groups)
    folder, pipe, files = sd3
    pool = LoraPool(pipe, max_loras=3, max_rank=8, device="cpu", dtype=torch.float32)
    for name, path in files.items():
        pool.add(read_lora(path, pipe, name))
    requests = [{"A": 1.0}, {"B": 0.7}, {"A": 0.5, "B": -1.2}, {}, {"A": 1.0}]
    requests += [{}, {"A": 1.0}] * MAX_RUNS  # A at scale 1 on more than MAX_RUNS runs of rows: gathered
    if dense:
        requests = [{"A": 1.0}, {"B": 0.7}, {"A": -0.5}, {"B": 1.0}, {"A": 1.0}]
    rows = [pool.acquire(r) for r in requests]
    inputs = sd3_inputs(len(rows))
    with pool.denoising(rows):
        mixed = forward(pipe.transformer, inputs)
    plan = LoraPlan(rows)
    plan.pairs()
    assert plan.dense == dense
    if not dense:
        assert any(g.index is not None for g in plan.groups) and any(g.index is None for g in plan.groups)

    reference = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    for i, request in enumerate(requests[:5]):  # (the later rows repeat these)
        diffusers_reference(reference, files, request)
        alone = forward(reference.transformer, {k: v[i:i + 1] for k, v in inputs.items()})
        torch.testing.assert_close(mixed[i:i + 1], alone, rtol=0, atol=1e-5)
    with pool.denoising([()] * len(rows)):  # no LoRA rows: the base model exactly
        base = forward(pipe.transformer, inputs)
    reference.disable_lora()
    torch.testing.assert_close(base, forward(reference.transformer, inputs), rtol=0, atol=0)
    assert (mixed[0] - base[0]).abs().max() > 1e-3
    if not dense:
        assert (mixed[3] - base[3]).abs().max() == 0


def test_conv_and_linear_rows(tiny_sd15_dir, tmp_path):
    """UNet conv (3x3 resnet convs, 1x1 proj_in) and linear LoRA per row."""
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    targets = ("conv1", "conv2", "proj_in", "to_q", "time_emb_proj")
    path = save_diffusers_lora(StableDiffusionPipeline, tmp_path / "C",
                               {"unet": (random_lora(pipe.unet, targets, 3, seed=5, conv=True), 3, 3.0)})
    pool = LoraPool(pipe, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    pool.add(read_lora(path, pipe, "C"))
    requests = [{}, {"C": 0.8}, {}]
    rows = [pool.acquire(r) for r in requests]
    g = torch.Generator().manual_seed(1)
    inputs = dict(sample=torch.randn(3, 4, 8, 8, generator=g), timestep=torch.tensor([10.0, 500.0, 900.0]),
                  encoder_hidden_states=torch.randn(3, 77, 32, generator=g))
    with pool.denoising(rows), torch.inference_mode():
        mixed = pipe.unet(**inputs, return_dict=False)[0]
    reference = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    for i, request in enumerate(requests):
        diffusers_reference(reference, {"C": path}, request)
        with torch.inference_mode():
            alone = reference.unet(**{k: v[i:i + 1] for k, v in inputs.items()}, return_dict=False)[0]
        torch.testing.assert_close(mixed[i:i + 1], alone, rtol=0, atol=1e-5)


def test_plan_rows():
    """Plans map module inputs with k rows per batch row, or any rows when uniform, and
    refuse the rest; `select` re-indexes."""
    a, b = ((0, 1.0),), ((1, 0.5),)
    plan = LoraPlan([a, (), b])
    stretched = plan.for_leading(6)
    assert stretched.rows == (a, a, (), (), b, b)
    with pytest.raises(LoraRowsError):
        plan.for_leading(4)
    assert LoraPlan([a, a]).for_leading(5).rows == (a,) * 5
    assert plan.select([2, 0]).rows == (b, a)
    assert not LoraPlan([(), ()]).active


def test_pool_slots(sd3):
    """acquire pins (same slot for every request of an adapter), LRU eviction of unpinned
    adapters, a full pool refuses, an adapter in use cannot be removed."""
    folder, pipe, files = sd3
    pool = LoraPool(pipe, max_loras=1, max_rank=4, device="cpu", dtype=torch.float32)
    for name, path in files.items():
        pool.add(read_lora(path, pipe, name))
    assert pool.acquire({"A": 1.0}) == ((0, 1.0),)
    assert pool.acquire({"A": 0.5}) == ((0, 0.5),)
    with pytest.raises(LoraSlotsFullError):
        pool.acquire({"B": 1.0})
    with pytest.raises(LoraInUseError):
        pool.remove("A")
    pool.release(["A", "A"])
    assert pool.acquire({"B": 1.0}) == ((0, 1.0),)  # A evicted
    assert pool.stats()["resident"] == ["B"]
    with pytest.raises(KeyError):
        pool.acquire({"C": 1.0})
    pool.release(["B"])
    pool.remove("B")
    assert pool.stats()["resident"] == [None]
    with pytest.raises(Exception, match="rank"):
        small = LoraPool(pipe, max_loras=1, max_rank=2, device="cpu", dtype=torch.float32)
        small.add(read_lora(files["A"], pipe, "A"))
    pool.close()
    assert pool.stats()["hooked_modules"] == 0
