"""torchao quantization of loaded components: which layers, their real bytes, kept layers,
pre-quantized folders and re-applying a plan to freshly loaded weights."""

from __future__ import annotations

import copy
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


@pytest.mark.parametrize("method", ["int8_weight_only", "int8_dynamic"])
def test_token_tables_become_int8_and_look_up_rows_only(method):
    """A text encoder's token table (>= MIN_ROWS rows) is stored as int8 rows + one scale per row
    and looked up without converting the whole table; position tables stay as they are."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffserve.quantization.embedding import MIN_ROWS, Int8Embedding, quantize_embeddings

    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=77, bos_token_id=0,
                            eos_token_id=2, pad_token_id=1)
    encoder = CLIPTextModel(config).eval()
    table = encoder.embeddings.token_embedding.weight.detach().clone()
    ids = torch.randint(0, 4096, (2, 77))
    with torch.inference_mode():
        reference = encoder(ids).last_hidden_state
    full = weight_bytes(encoder)
    table_only = copy.deepcopy(encoder)
    assert quantize_embeddings(table_only) == ["embeddings.token_embedding"]
    report = quantize_component("text_encoder", encoder, method)
    tokens = encoder.embeddings.token_embedding
    assert isinstance(tokens, Int8Embedding) and tokens.qdata.dtype == torch.int8
    assert type(encoder.embeddings.position_embedding) is torch.nn.Embedding  # 77 < MIN_ROWS
    assert 77 < MIN_ROWS <= 4096
    assert report.quantized_layers == len(linear_layers(CLIPTextModel(config))) + 1
    assert report.bytes == weight_bytes(encoder) and tensor_bytes(tokens.qdata) == 4096 * 32
    # each element within half a quantization step of its row's scale
    err = (tokens(torch.arange(4096)) - table).abs()
    assert bool((err <= tokens.scale / 2 + 1e-7).all())
    assert torch.equal(tokens.weight, tokens(torch.arange(4096)))
    with torch.inference_mode():
        out, out_table_only = encoder(ids).last_hidden_state, table_only(ids).last_hidden_state
    assert float((out - reference).norm() / reference.norm()) < 0.05
    assert float((out_table_only - reference).norm() / reference.norm()) < 0.01  # the table's own share
    assert report.bytes < 0.30 * full


def test_shared_token_table_is_quantized_once_and_patterns_keep_tables():
    """T5's `shared` table is also `encoder.embed_tokens`: one int8 copy under both names; a skip
    pattern naming the table keeps it in full precision."""
    from transformers import T5Config, T5EncoderModel

    from diffserve.quantization.embedding import Int8Embedding

    config = T5Config(vocab_size=2048, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    encoder = T5EncoderModel(config)
    quantize_component("text_encoder_3", encoder, "int8_dynamic")
    assert isinstance(encoder.shared, Int8Embedding) and encoder.encoder.embed_tokens is encoder.shared
    assert type(encoder.encoder.block[0].layer[0].SelfAttention.relative_attention_bias) is torch.nn.Embedding
    kept = T5EncoderModel(config)
    quantize_component("text_encoder_3", kept, "int8_dynamic", patterns=("text_encoder_3.shared",))
    assert type(kept.shared) is type(kept.encoder.embed_tokens) is torch.nn.Embedding  # both names kept
    assert kept.encoder.embed_tokens.weight is kept.shared.weight
