"""The automatic skip list on a denoiser where one block dominates the quantization error."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3Transformer2DModel

from diffserve.quantization.apply import is_quantized_tensor, linear_layers, quantize_component
from diffserve.quantization.skip_search import CalibrationInputs, layer_type, relative_error, search_skip_list

BUDGET = 0.01
SCALED_BLOCK = 1


def _transformer(scale: float) -> SD3Transformer2DModel:
    """A 4-block tiny SD3 transformer; block 1's attention projections (q, k, v, out of both
    streams) scaled by `scale`: its attention logits grow by scale^2, so the rounding of its
    weights moves the output far more than any other block's."""
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
                                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                  pooled_projection_dim=64, out_channels=4, pos_embed_max_size=32).eval()
    with torch.no_grad():
        for module in model.transformer_blocks[SCALED_BLOCK].attn.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(scale)
    return model


def _calibration(model) -> CalibrationInputs:
    inputs = CalibrationInputs()
    g = torch.Generator().manual_seed(1)
    with inputs.record(model), torch.inference_mode():
        for t in (900.0, 500.0, 100.0):  # across the timestep range
            model(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(2, 12, 32, generator=g),
                  pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([t, t]),
                  return_dict=False)
    return inputs


def test_calibration_inputs_record_and_replay():
    model = _transformer(1.0)
    inputs = _calibration(model)
    assert len(inputs) == 3
    first = inputs.replay(model)
    assert len(first) == 3 and first[0].shape == (2, 4, 8, 8)
    assert relative_error(inputs.replay(model), first) == 0.0


@pytest.mark.parametrize("method", ["int8_weight_only", "int8_dynamic"])
def test_dominating_block_is_kept_with_fewer_layers_than_its_layer_types(method):
    model = _transformer(10.0)
    inputs = _calibration(model)
    reference = inputs.replay(model)
    result = search_skip_list("transformer", model, method, inputs, BUDGET)
    assert not any(is_quantized_tensor(m.weight) for m in linear_layers(model).values())  # left unquantized

    assert result.error_all_quantized > BUDGET >= result.error  # the search had to keep layers, and met the budget
    in_blocks = [n for n in result.kept if n.startswith("transformer_blocks.")]
    assert in_blocks and all(n.startswith(f"transformer_blocks.{SCALED_BLOCK}.") for n in in_blocks)
    ranked = sorted(result.sensitivities, key=lambda n: -result.sensitivities[n])
    top_block_layer = next(n for n in ranked if n.startswith("transformer_blocks."))
    assert top_block_layer.startswith(f"transformer_blocks.{SCALED_BLOCK}.") and top_block_layer in result.kept
    # keeping every layer of the kept layers' types (what a hand-written list does) keeps more
    kept_types = set(result.kept_types())
    same_types = [n for n in linear_layers(model) if layer_type(n) in kept_types]
    assert len(result.kept) < len(same_types)

    quantize_component("transformer", model, method, kept=result.kept)
    assert relative_error(inputs.replay(model), reference) == pytest.approx(result.error, rel=1e-5)


def test_nothing_kept_when_within_budget():
    model = _transformer(1.0)
    result = search_skip_list("transformer", model, "int8_weight_only", _calibration(model), 0.5)
    assert result.kept == [] and result.error == result.error_all_quantized <= 0.5 and result.replays == 2
