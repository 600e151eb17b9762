"""Reading LoRA files (`diffserve.lora.reading`): every family, diffusers and non-diffusers
layouts, against what diffusers' own ``load_lora_weights`` puts into PEFT layers.

Compared per module: the effective update ``scaling * B @ A`` (conv: ``B`` 1x1 times ``A``
flattened), so ranks, alphas, rank patterns and the layouts' alpha conventions are all checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import (
    FluxKontextPipeline,
    FluxPipeline,
    QwenImageEditPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    WanPipeline,
)
from safetensors.torch import save_file
from tiny_models.registry import BY_ID
from tiny_models.loras import (
    diffusers_reference,
    random_lora,
    save_diffusers_lora,
    save_file_lora,
    to_kohya_unet,
    to_onetrainer,
    to_sai_sd3,
)

from diffserve.lora.reading import LoraFileError, read_lora

from .families import ATTN, FAMILIES

#: (registry model id, pipeline class) per family
CASES = {
    "sd3": ("StableDiffusion3Pipeline", StableDiffusion3Pipeline),
    "flux": ("FluxPipeline-schnell", FluxPipeline),
    "flux_kontext": ("FluxKontextPipeline", FluxKontextPipeline),
    "sd15": ("StableDiffusionPipeline", StableDiffusionPipeline),
    "sdxl": ("StableDiffusionXLPipeline", StableDiffusionXLPipeline),
    "qwen_image": ("QwenImagePipeline", QwenImagePipeline),
    "qwen_image_edit": ("QwenImageEditPipeline", QwenImageEditPipeline),
    "wan": ("WanPipeline-2.1", WanPipeline),
}


def load(key: str, folder: Path):
    model_id, cls = CASES[key]
    pipe = cls.from_pretrained(folder, **BY_ID[model_id].reference_load(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The effective weight update (out, in * prod(kernel))."""
    return scaling * (b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1))


def peft_deltas(pipe, component: str, name: str) -> dict[str, torch.Tensor]:
    from peft.tuners.lora import LoraLayer

    out = {}
    for path, layer in getattr(pipe, component).named_modules():
        if isinstance(layer, LoraLayer) and name in layer.lora_A:
            out[path] = delta(layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name])
    return out


@pytest.mark.parametrize("key", list(CASES))
def test_read_matches_diffusers(key, tiny_folder, tmp_path):
    model_id, cls = CASES[key]
    family = FAMILIES[cls.__name__]
    folder = tiny_folder(model_id)
    pipe = load(key, folder)
    parts = family.parts(pipe, seed=1)
    saved = save_diffusers_lora(cls, tmp_path / "diffusers", parts)
    adapter = read_lora(saved, pipe, "a")
    assert adapter.format == "diffusers"
    assert set(adapter.components) == {family.denoiser, *family.text_encoders}

    reference = diffusers_reference(load(key, folder), {"a": saved}, {"a": 1.0})
    for component, modules in adapter.modules.items():
        expected = peft_deltas(reference, component, "a")
        assert set(expected) == set(modules), component
        for path, m in modules.items():
            torch.testing.assert_close(delta(m.a, m.b, m.scaling), expected[path], rtol=1e-5, atol=1e-6)

    if family.layout is not None:  # the same adapter in the layout people ship gives the same updates
        other = read_lora(save_file_lora(family.non_diffusers(pipe, parts), tmp_path / "other.safetensors"), pipe, "b")
        assert other.format != "diffusers"
        for component, modules in adapter.modules.items():
            got = other.modules[component]
            assert set(got) == set(modules), component
            for path, m in modules.items():
                g = got[path]
                torch.testing.assert_close(delta(g.a, g.b, g.scaling), delta(m.a, m.b, m.scaling),
                                           rtol=1e-5, atol=1e-6)


def test_peft_folder(tiny_sd3_dir, tmp_path):
    """A PEFT ``save_pretrained`` folder (``adapter_model.safetensors`` + ``adapter_config.json``
    with lora_alpha != r) reads with PEFT's scaling."""
    import json

    pipe = load("sd3", tiny_sd3_dir)
    state_dict = random_lora(pipe.transformer, ATTN, 4, seed=3)
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file({f"base_model.model.{k}": v for k, v in state_dict.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 2, "target_modules": list(ATTN), "use_rslora": True}))
    adapter = read_lora(folder, pipe, "p")
    assert adapter.format == "peft"
    path = "transformer_blocks.0.attn.to_q"
    m = adapter.modules["transformer"][path]
    assert m.scaling == pytest.approx(2 / 4 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    torch.testing.assert_close(m.a, state_dict[f"{path}.lora_A.weight"])


def test_refusals(tiny_sd3_dir, tiny_sd15_dir, tmp_path):
    """Files that do not (fully) match the model, or hold kinds per-row math cannot add, are
    refused naming ``path`` with counts and examples."""
    sd3 = load("sd3", tiny_sd3_dir)
    sd15 = load("sd15", tiny_sd15_dir)
    sd15_parts = FAMILIES["StableDiffusionPipeline"].parts(sd15, seed=2)
    sd15_file = save_diffusers_lora(StableDiffusionPipeline, tmp_path / "sd15", sd15_parts)
    with pytest.raises(LoraFileError) as info:  # an SD 1.5 LoRA on an SD3 model: nothing matches
        read_lora(sd15_file, sd3, "x")
    assert info.value.field == "path" and "0 of" in str(info.value) and "unmatched" in str(info.value)

    partial = random_lora(sd3.transformer, ATTN, 4, seed=4)
    partial["transformer_blocks.0.attn.to_nowhere.lora_A.weight"] = torch.zeros(4, 32)
    partial["transformer_blocks.0.attn.to_nowhere.lora_B.weight"] = torch.zeros(32, 4)
    path = save_diffusers_lora(StableDiffusion3Pipeline, tmp_path / "partial", {"transformer": (partial, 4, 4.0)})
    with pytest.raises(LoraFileError, match=r"of \d+ LoRA modules matched, 1 unmatched .*to_nowhere"):
        read_lora(path, sd3, "x")

    sd3_parts = FAMILIES["StableDiffusion3Pipeline"].parts(sd3, seed=5, text=False)
    modules = len({k.split(".lora_")[0] for k in sd3_parts["transformer"][0]})
    kohya = to_sai_sd3(sd3_parts, len(sd3.transformer.transformer_blocks))
    for extra, rows in (("lora_unet_joint_blocks_7_x_block_attn_qkv", 96),
                        ("lora_te3_encoder_block_0_layer_0_SelfAttention_q", 32)):
        other = dict(kohya)  # another model's block (SD3.5 large has 38); T5, which diffusers adapts in no SD3
        other.update({f"{extra}.lora_down.weight": torch.zeros(4, 32), f"{extra}.lora_up.weight": torch.zeros(rows, 4),
                      f"{extra}.alpha": torch.tensor(4.0)})
        with pytest.raises(LoraFileError, match=rf"{modules} of {modules + 1} LoRA modules matched, 1 unmatched "
                                                rf"\(e.g. {extra}\)"):
            read_lora(save_file_lora(other, tmp_path / "kohya_sd3.safetensors"), sd3, "x")
    wrong = dict(kohya)
    wrong["lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight"] = torch.zeros(288, 3)
    with pytest.raises(LoraFileError, match="lora_up has 288 output rows"):
        read_lora(save_file_lora(wrong, tmp_path / "kohya_sd3_wrong.safetensors"), sd3, "x")

    dora = to_kohya_unet(sd15_parts)
    dora["lora_unet_down_blocks_0_attentions_0_proj_in.dora_scale"] = torch.ones(1, 32)
    with pytest.raises(LoraFileError, match="DoRA"):
        read_lora(save_file_lora(dora, tmp_path / "dora.safetensors"), sd15, "x")
    with pytest.raises(LoraFileError, match="existing"):
        read_lora(tmp_path / "missing.safetensors", sd15, "x")
    pickle = tmp_path / "x.bin"
    pickle.write_bytes(b"0")
    with pytest.raises(LoraFileError, match="pickle"):
        read_lora(pickle, sd15, "x")


def test_sd35_sai_layouts(tiny_sd3_dir, tmp_path):
    """SD3.5-medium layout (dual attention in block 0, qk norm), every linear and the patch conv
    adapted: the kohya file (x-block q/k/v with one shared down, context and attn2 q/k/v
    block-diagonal, alphas), the ComfyUI ``diffusion_model.`` file (scale baked in) and the
    OneTrainer / SimpleTuner LyCORIS files (diffusers names) read as the updates diffusers loads
    from the diffusers file, swapped adaLN halves included."""
    from diffusers import SD3Transformer2DModel

    def sd35():
        pipe = load("sd3", tiny_sd3_dir)
        config = {**pipe.transformer.config, "dual_attention_layers": (0,), "qk_norm": "rms_norm"}
        pipe.transformer = SD3Transformer2DModel.from_config(config)
        return pipe

    pipe = sd35()
    state_dict = random_lora(pipe.transformer, ("",), 2, seed=6, conv=True)
    for key in [k for k in state_dict if k.endswith(".attn.to_q.lora_A.weight")]:
        for other in ("to_k", "to_v"):
            state_dict[key.replace(".to_q.", f".{other}.")] = state_dict[key].clone()
    parts = {"transformer": (state_dict, 2, 3.0)}
    saved = save_diffusers_lora(StableDiffusion3Pipeline, tmp_path / "diffusers", parts)
    expected = peft_deltas(diffusers_reference(sd35(), {"a": saved}, {"a": 1.0}), "transformer", "a")
    assert {"transformer_blocks.0.attn2.to_q", "transformer_blocks.1.norm1_context.linear", "norm_out.linear",
            "pos_embed.proj"} <= set(expected)
    num_blocks = len(pipe.transformer.transformer_blocks)
    layouts = {"kohya": to_sai_sd3(parts, num_blocks), "comfy": to_sai_sd3(parts, num_blocks, comfy=True),
               "onetrainer": to_onetrainer(parts), "lycoris": to_onetrainer(parts, prefix="lycoris_")}
    for layout, state in layouts.items():
        modules = read_lora(save_file_lora(state, tmp_path / f"{layout}.safetensors"), pipe, "k").modules["transformer"]
        assert set(modules) == set(expected), layout
        for module_path, m in modules.items():
            torch.testing.assert_close(delta(m.a, m.b, m.scaling), expected[module_path].flatten(1), rtol=1e-5,
                                       atol=1e-6, msg=lambda msg: f"{module_path} ({layout}): {msg}")
        assert modules["transformer_blocks.0.attn.add_k_proj"].rank == 2, layout  # block-diagonal split back


def test_xlabs_flux_reads_as_diffusers_converts_it(tiny_folder, tmp_path):
    """An XLabs Flux file (``double_blocks.N.processor.{qkv,proj}_lora{1,2}.{down,up}``: q/k/v fused
    with one shared down projection) reads as the updates diffusers' own XLabs conversion loads."""
    pipe = load("flux", tiny_folder(CASES["flux"][0]))
    inner = pipe.transformer.transformer_blocks[0].attn.to_q.out_features
    g = torch.Generator().manual_seed(5)
    state = {}
    for block in range(len(pipe.transformer.transformer_blocks)):
        for name, outs in (("qkv_lora1", 3), ("qkv_lora2", 3), ("proj_lora1", 1), ("proj_lora2", 1)):
            key = f"double_blocks.{block}.processor.{name}"
            state[f"{key}.down.weight"] = torch.randn(4, inner, generator=g) / inner ** 0.5
            state[f"{key}.up.weight"] = torch.randn(outs * inner, 4, generator=g) * 0.1
    path = save_file_lora(state, tmp_path / "xlabs.safetensors")
    adapter = read_lora(path, pipe, "x")
    assert adapter.format != "diffusers"
    expected = peft_deltas(diffusers_reference(load("flux", tiny_folder(CASES["flux"][0])), {"x": path}, {"x": 1.0}),
                           "transformer", "x")
    modules = adapter.modules["transformer"]
    assert set(modules) == set(expected) and len(expected) == 8 * len(pipe.transformer.transformer_blocks)
    for module_path, m in modules.items():
        torch.testing.assert_close(delta(m.a, m.b, m.scaling), expected[module_path], rtol=1e-5, atol=1e-6)
