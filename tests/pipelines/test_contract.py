"""The step contract's shared mechanics: per-row data in the step batch (collation, the forward
context, narrowing, CFG-parallel slices), the declared strategies (guidance, expert routing) and
the declarative model spec. The families' behaviour is the conformance suite's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffserve import SamplingParams
from diffserve.core.sampling_params import RequestLimits
from diffserve.parallel.cfg import slice_batch
from diffserve.pipelines.experts import HIGH_NOISE_STEPS, ExpertRouting
from diffserve.pipelines.generation_config import model_spec
from diffserve.pipelines.guidance import CFG, TRUE_CFG, Guidance
from diffserve.pipelines.request_state import RequestState
from diffserve.pipelines.row_data import (
    NO_ROW_DATA,
    RowData,
    collate_row_data,
    current_rows,
    forward_rows,
    narrowed_rows,
)


def _state(name: str, images: int = 1, **row_data) -> RequestState:
    state = RequestState(name, "x", SamplingParams(num_images_per_prompt=images))
    state.row_data.update(row_data)
    return state


def test_row_data_is_laid_out_branch_major_over_each_requests_rows():
    states = [_state("a", 1, lora=("s1",)), _state("b", 2), _state("c", 1, lora=("s2",), spans=3)]
    rows = collate_row_data(states, branches=2)
    assert rows.num_rows == 8 and set(rows) == {"lora", "spans"}
    # branch 0 then branch 1, each over latent rows a, b, b, c
    assert rows["lora"] == (("s1",), None, None, ("s2",)) * 2
    assert rows["spans"] == (None, None, None, 3) * 2
    assert collate_row_data([_state("a"), _state("b")], branches=2) is NO_ROW_DATA


def test_row_data_selects_pads_and_converts():
    rows = RowData({"k": (1, 2, 3), "same": (7, 7, 7)}, 3)
    assert rows.select([2, 0]) == {"k": (3, 1), "same": (7, 7)} and rows.select([2, 0]).num_rows == 2
    assert rows.select(torch.tensor([1])) == {"k": (2,), "same": (7,)}
    assert rows.padded(5)["k"] == (1, 2, 3, 3, 3) and rows.padded(2) is rows
    assert rows.uniform("same") == 7 and rows.uniform("absent", default=-1) == -1
    with pytest.raises(ValueError, match="different 'k' values"):
        rows.uniform("k")
    tensor = rows.tensor("k", torch.long, "cpu")
    assert tensor.tolist() == [1, 2, 3] and rows.tensor("k", torch.long, "cpu") is tensor  # once per RowData
    assert RowData({"k": (None, 4)}, 2).tensor("k", torch.float32, "cpu").tolist() == [0.0, 4.0]
    assert hash(rows) == hash(RowData({"same": (7, 7, 7), "k": (1, 2, 3)}, 3))


def test_forward_context_is_scoped_and_narrowed():
    rows = RowData({"k": (10, 11, 12, 13)}, 4)
    assert current_rows() is NO_ROW_DATA
    with forward_rows(rows):
        assert current_rows() is rows
        with narrowed_rows(torch.tensor([3, 1])):
            assert current_rows()["k"] == (13, 11)
        assert current_rows() is rows
    assert current_rows() is NO_ROW_DATA
    with narrowed_rows([0]):  # outside a forward: nothing to narrow
        assert current_rows() is NO_ROW_DATA


def test_the_denoiser_reads_each_rows_data_in_the_forward(engine):
    """A step batch of two requests with CFG (1 and 2 images) runs one forward in which the
    transformer sees every row's data in branch-major order; a CFG-parallel share of the rows
    sees its own rows'; after the forward the context is empty again."""
    adapter = engine.runner.adapter
    states = []
    for name, images in (("a", 1), ("b", 2)):
        params = SamplingParams(seed=1, num_inference_steps=2, guidance_scale=4.0, num_images_per_prompt=images,
                                height=64, width=64).resolve(adapter.spec, RequestLimits(), 0)
        state = RequestState(name, "a cat", params)
        adapter.prepare(state)
        state.row_data["tag"] = name
        states.append(state)
    seen = []
    hook = adapter.denoiser.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((current_rows().get("tag"), kwargs["hidden_states"].shape[0])),
        with_kwargs=True)
    try:
        with torch.inference_mode():
            batch = adapter.collate(states)
            adapter.denoise(batch)
            adapter.denoise(slice_batch(batch, 2, 5))
    finally:
        hook.remove()
    assert seen == [(("a", "b", "b") * 2, 6), (("b", "a", "b"), 3)]
    assert current_rows() is NO_ROW_DATA
    for state in states:  # the same requests one step further: the composition's row data is reused
        state.step_index += 1
    assert adapter.collate(states).row_data is batch.row_data


def test_guidance_strategies_follow_diffusers_branch_rules():
    p = SamplingParams
    assert CFG.branches(p(guidance_scale=1.0)) == 1 and CFG.branches(p(guidance_scale=3.0)) == 2
    assert TRUE_CFG.branches(p(true_cfg_scale=3.0)) == 1  # no negative prompt: diffusers runs one branch
    assert TRUE_CFG.branches(p(true_cfg_scale=3.0, negative_prompt="")) == 2
    assert TRUE_CFG.branches(p(true_cfg_scale=1.0, negative_prompt="x")) == 1
    embedded = Guidance("true_cfg_scale", embedded=True)
    assert embedded.fields == ("true_cfg_scale", "guidance_scale") and TRUE_CFG.fields == ("true_cfg_scale",)
    inputs = embedded.branch_inputs(p(guidance_scale=3.5), 2, "cpu")
    assert inputs["guidance"].dtype == torch.float32 and inputs["guidance"].tolist() == [3.5, 3.5]
    assert CFG.branch_inputs(p(guidance_scale=3.5), 2, "cpu") == {}
    uncond, cond = torch.zeros(2, 3, 4), torch.ones(2, 3, 4)
    assert torch.equal(CFG.combine(uncond, cond, 2.0), torch.full((2, 3, 4), 2.0))
    rescaled = Guidance("true_cfg_scale", norm_rescale=True).combine(uncond, cond, 2.0)
    assert torch.allclose(rescaled.norm(dim=-1), cond.norm(dim=-1))


def test_expert_routing_switches_at_the_boundary():
    routing = ExpertRouting([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)], boundary=875.0)
    state = RequestState("r", "x", SamplingParams(guidance_scale=4.0, guidance_scale_2=2.0))
    state.timesteps = torch.tensor([999.0, 900.0, 875.0, 500.0, 100.0])
    routing.start(state)
    assert state.extra[HIGH_NOISE_STEPS] == 3
    keys = []
    for step in range(6):
        state.step_index = step
        keys.append(routing.step_key(state))
    assert keys == [0, 0, 0, 1, 1, None]
    late = dataclasses.replace(state, step_index=4)
    state.step_index = 0
    assert routing.guidance_weights([state, late]) == [4.0, 2.0]
    with pytest.raises(ValueError, match="different experts"):
        routing.batch_expert([state, late])
    assert len(routing.module) == 2


def test_model_spec_overlays_the_folders_generation_config():
    spec = model_spec("P", {"height": 512, "width": 512, "num_inference_steps": 28, "guidance_scale": 7.0,
                            "max_sequence_length": 256},
                      {"num_inference_steps": 8, "guidance_scale": 3, "teacache": {"rel_l1_thresh": 0.1}},
                      {"resolution_factor": 16, "max_height": 1024})
    assert (spec.default_num_inference_steps, spec.default_guidance_scale) == (8, 3.0)
    assert isinstance(spec.default_guidance_scale, float) and spec.default_max_sequence_length == 256
    assert spec.default_true_cfg_scale is None and spec.max_height == 1024 and spec.pipeline == "P"
    assert model_spec("P", {"height": 8, "width": 8, "num_inference_steps": 2}, {},
                      {"resolution_factor": 8}).default_guidance_scale is None
    with pytest.raises(KeyError):
        model_spec("P", {"height": 8, "width": 8, "num_inference_steps": 2, "eta": 0.0}, {}, {"resolution_factor": 8})


def test_families_stay_within_the_contracts_size_targets():
    """Issue 23's targets for the slim contract, counted by `contract_size`: a plain DiT family's
    adapter is at most 100 lines of code, and Wan (streams, two experts, context folding)
    overrides at most 6 of the contract's methods."""
    from pathlib import Path

    from tests.pipelines.contract_size import family_sizes

    sizes = family_sizes(Path(__file__).resolve().parents[2])
    assert sizes["flux"]["adapter"] <= 100 and sizes["qwen_image"]["adapter"] <= 100, \
        {f: s["adapter"] for f, s in sizes.items()}
    assert len(sizes["wan"]["hooks"]) <= 6, sizes["wan"]["hooks"]
