"""GGUF single-file transformers through diffusers' GGUF support: loaded and dequantized on the
fly; a file of another architecture or size refused at load with a clear error."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from tiny_models.gguf import write_gguf

from diffserve.core.errors import UnsupportedModelError
from diffserve.quantization.apply import describe_loaded
from diffserve.quantization.gguf import load_gguf_transformer


@pytest.fixture(scope="module")
def sd3_transformer(tiny_sd3_dir):
    return SD3Transformer2DModel.from_pretrained(tiny_sd3_dir / "transformer").eval()


def test_gguf_transformer_loads_and_matches(tiny_sd3_dir, sd3_transformer, tmp_path):
    path = write_gguf(sd3_transformer.state_dict(), tmp_path / "sd3-Q8_0.gguf", arch="sd3")
    model = load_gguf_transformer(path, SD3Transformer2DModel, tiny_sd3_dir / "transformer", torch.float32)
    to_q = model.transformer_blocks[0].attn.to_q
    assert type(to_q).__name__ == "GGUFLinear" and type(to_q.weight).__name__ == "GGUFParameter"
    report = describe_loaded("transformer", model, torch.float32)
    assert report.method == "gguf:Q8_0" and report.source == "gguf file"
    assert report.bytes < 0.7 * report.full_precision_bytes  # Q8_0: 34 bytes per 32 weights
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=g),
                  pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([500.0]),
                  return_dict=False)
    with torch.inference_mode():
        reference, out = sd3_transformer(**inputs)[0], model(**inputs)[0]
    assert float((out - reference).norm() / reference.norm()) < 0.02


def test_gguf_of_another_architecture_is_refused(tiny_sd3_dir, tiny_flux_dir, tmp_path):
    flux = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    path = write_gguf(flux.state_dict(), tmp_path / "flux.gguf", arch="flux")
    with pytest.raises(UnsupportedModelError) as info:
        load_gguf_transformer(path, SD3Transformer2DModel, tiny_sd3_dir / "transformer", torch.float32)
    message = str(info.value)
    assert "flux.gguf" in message and "architecture 'flux'" in message and "SD3Transformer2DModel" in message
    assert "missing" in message and "\n" not in message


def test_gguf_of_another_size_is_refused(tiny_sd3_dir, sd3_transformer, tmp_path):
    bigger = SD3Transformer2DModel(**{**dict(sd3_transformer.config), "num_layers": 3})
    path = write_gguf(bigger.state_dict(), tmp_path / "sd3-3-layers.gguf")
    with pytest.raises(UnsupportedModelError, match=r"tensors \d+ unexpected \(e.g. transformer_blocks\.1\."):
        load_gguf_transformer(path, SD3Transformer2DModel, tiny_sd3_dir / "transformer", torch.float32)


def test_original_layout_that_does_not_convert_is_refused(tiny_sd3_dir, tmp_path):
    path = write_gguf({"model.diffusion_model.x.weight": torch.zeros(4, 32)}, tmp_path / "other.gguf", arch="sdxl")
    with pytest.raises(UnsupportedModelError, match="do not convert to SD3Transformer2DModel"):
        load_gguf_transformer(path, SD3Transformer2DModel, tiny_sd3_dir / "transformer", torch.float32)


def test_missing_or_non_gguf_file(tiny_sd3_dir, tmp_path):
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        load_gguf_transformer(tmp_path / "nope.gguf", SD3Transformer2DModel, tiny_sd3_dir / "transformer",
                              torch.float32)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        load_gguf_transformer(bad, SD3Transformer2DModel, tiny_sd3_dir / "transformer", torch.float32)


def test_gguf_in_the_original_layout_converts(tiny_sd3_dir, sd3_transformer, tmp_path):
    """Published GGUF files of SD3 keep Stability's key layout; diffusers converts it on load."""
    from tiny_models.gguf import sd3_original_layout

    original = sd3_original_layout(sd3_transformer.state_dict(), sd3_transformer.config.num_layers)
    assert "joint_blocks.0.x_block.attn.qkv.weight" in original
    path = write_gguf(original, tmp_path / "sd3-original-Q8_0.gguf")
    model = load_gguf_transformer(path, SD3Transformer2DModel, tiny_sd3_dir / "transformer", torch.float32)
    assert type(model.transformer_blocks[0].attn.to_q.weight).__name__ == "GGUFParameter"
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=g),
                  pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([500.0]),
                  return_dict=False)
    with torch.inference_mode():
        reference, out = sd3_transformer(**inputs)[0], model(**inputs)[0]
    assert float((out - reference).norm() / reference.norm()) < 0.02
