"""torchao quantization of loaded components: which layers, their real bytes, kept layers,
pre-quantized folders and re-applying a plan to freshly loaded weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from diffserve.quantization.apply import (
    describe_loaded,
    is_quantized_tensor,
    linear_layers,
    quantize_component,
    weight_bytes,
)
from diffserve.quantization.plan import apply_plan, quantize_model
from diffserve.core.quantization import QuantizationSpec
from diffserve.core.tensor_storage import inner_tensors, tensor_bytes
from diffserve.runner.loader import load_components


def _transformer_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(2, 12, 32, generator=g),
                pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([900.0, 100.0]),
                return_dict=False)


@pytest.fixture
def components(tiny_sd3_dir):
    return load_components(tiny_sd3_dir, torch.float32)[1]


@pytest.mark.parametrize("method", ["int8_weight_only", "int8_dynamic"])
def test_int8_quantizes_every_linear_and_counts_real_bytes(components, method):
    transformer = components["transformer"]
    inputs = _transformer_inputs()
    with torch.inference_mode():
        reference = transformer(**inputs)[0]
    layers = list(linear_layers(transformer))
    fp32_linear = sum(m.weight.numel() * 4 for m in linear_layers(transformer).values())
    report = quantize_component("transformer", transformer, method)
    assert report.quantized_layers == len(layers) and report.kept_layers == []
    weights = [transformer.get_submodule(n).weight for n in layers]
    assert all(is_quantized_tensor(w) for w in weights)
    # real storage: int8 data + per-row fp32 scales (+ int8 zero points), not the logical fp32 size
    q_bytes = sum(tensor_bytes(w) for w in weights)
    assert q_bytes == sum(w.qdata.numel() + w.scale.numel() * 4 + w.zero_point.numel() for w in weights)
    assert q_bytes < 0.3 * fp32_linear
    assert {name for w in weights for name, _ in inner_tensors(w)} == {"qdata", "scale", "zero_point"}
    assert report.bytes == weight_bytes(transformer) < report.full_precision_bytes
    with torch.inference_mode():
        out = transformer(**inputs)[0]
    assert float((out - reference).norm() / reference.norm()) < 0.02


def test_patterns_keep_layers_in_full_precision(components):
    transformer = components["transformer"]
    report = quantize_component("transformer", transformer, "int8_dynamic", patterns=("*.ff.net.2", "transformer.proj_out"))
    kept = sorted(report.kept_layers)
    assert kept == ["transformer.proj_out"] + [f"transformer.transformer_blocks.{i}.ff.net.2" for i in range(2)]
    assert type(transformer.proj_out.weight) is torch.nn.Parameter
    assert is_quantized_tensor(transformer.transformer_blocks[0].ff.net[0].proj.weight)


def test_single_method_quantizes_denoiser_and_text_encoders_not_vae(components):
    result = quantize_model(components, QuantizationSpec.parse("int8_weight_only"), torch.float32)
    assert sorted(result.reports) == ["text_encoder", "text_encoder_2", "transformer"]
    assert not any(is_quantized_tensor(p) for p in components["vae"].parameters())
    assert result.plan.methods == {c: "int8_weight_only" for c in result.reports}
    report = result.as_dict()["components"]["transformer"]
    assert report["source"] == "quantized at load" and report["ratio"] < 0.6


def test_plan_reapplies_to_fresh_weights(tiny_sd3_dir, components):
    spec = QuantizationSpec.parse({"transformer": "int8_dynamic"}, skip="*.attn.to_q")
    result = quantize_model(components, spec, torch.float32)
    fresh = load_components(tiny_sd3_dir, torch.float32)[1]
    apply_plan(fresh, result.plan, torch.float32)
    a, b = components["transformer"].state_dict(), fresh["transformer"].state_dict()
    for name, tensor in a.items():
        assert type(tensor) is type(b[name])
        for (n1, x), (n2, y) in zip(inner_tensors(tensor), inner_tensors(b[name])):
            assert n1 == n2 and torch.equal(x, y)
    assert type(fresh["transformer"].transformer_blocks[0].attn.to_q.weight) is torch.nn.Parameter


def test_prequantized_folder_loads_and_is_reported(tiny_sd3_dir, tmp_path, caplog):
    from diffusers import SD3Transformer2DModel, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    folder = tmp_path / "prequantized"
    shutil.copytree(tiny_sd3_dir, folder)
    quantized = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir / "transformer", torch_dtype=torch.float32,
                                                      quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    shutil.rmtree(folder / "transformer")
    quantized.save_pretrained(folder / "transformer")
    assert json.loads((folder / "transformer" / "config.json").read_text())["quantization_config"]["quant_method"] \
        == "torchao"
    components = load_components(folder, torch.float32)[1]
    transformer = components["transformer"]
    assert is_quantized_tensor(transformer.transformer_blocks[0].attn.to_q.weight)
    report = describe_loaded("transformer", transformer, torch.float32)
    assert report.method == "torchao:Int8WeightOnlyConfig" and report.source == "pre-quantized folder"
    full_precision = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir / "transformer")
    assert report.quantized_layers == len(linear_layers(full_precision)) and not linear_layers(transformer)
    assert report.bytes == weight_bytes(transformer) < report.full_precision_bytes
    with caplog.at_level("WARNING"):
        result = quantize_model(components, QuantizationSpec.parse("int8_dynamic"), torch.float32)
    assert "arrived quantized" in caplog.text
    assert result.reports["transformer"].source == "pre-quantized folder"
    assert result.reports["text_encoder"].method == "int8_dynamic"
    assert "transformer" not in result.plan.methods


def test_describe_loaded_is_none_for_full_precision(components):
    assert describe_loaded("vae", components["vae"], torch.float32) is None
    plain = torch.ones(3, 4)
    assert tensor_bytes(plain) == 48 and not is_quantized_tensor(plain)
