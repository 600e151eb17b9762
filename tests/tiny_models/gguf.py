"""Write a GGUF file from a state dict (gguf-py, llama.cpp's writer), offline.

Weights of 2-D tensors whose last dimension is a multiple of the ggml block size (32) are stored
in `qtype` (Q8_0 by default); everything else in F32. Tensor names are written as given (the
diffusers layout, which diffusers' ``from_single_file`` loads without conversion).
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_gguf(state_dict: dict[str, torch.Tensor], path: Path, arch: str = "sd3", qtype: str = "Q8_0") -> Path:
    """Write `state_dict` to `path` as GGUF with ``general.architecture = arch``; returns `path`."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    writer = gguf.GGUFWriter(str(path), arch)
    for name, tensor in state_dict.items():
        data = tensor.detach().float().cpu().numpy()
        if tensor.ndim == 2 and tensor.shape[1] % block == 0 and name.endswith(".weight"):
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def sd3_original_layout(state_dict: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """An ``SD3Transformer2DModel`` state dict in the original (Stability / ComfyUI) layout that
    GGUF files of SD3 use (``joint_blocks.N.x_block.attn.qkv``, ``final_layer``, ...): the
    inverse of diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers`` for models
    without qk-norm or dual attention."""
    sd = dict(state_dict)

    def swap(t: torch.Tensor) -> torch.Tensor:  # diffusers' swap_scale_shift is its own inverse
        shift, scale = t.chunk(2, dim=0)
        return torch.cat([scale, shift], dim=0)

    out = {"pos_embed": sd.pop("pos_embed.pos_embed"), "x_embedder.proj.weight": sd.pop("pos_embed.proj.weight"),
           "x_embedder.proj.bias": sd.pop("pos_embed.proj.bias"),
           "context_embedder.weight": sd.pop("context_embedder.weight"),
           "context_embedder.bias": sd.pop("context_embedder.bias"),
           "final_layer.linear.weight": sd.pop("proj_out.weight"), "final_layer.linear.bias": sd.pop("proj_out.bias"),
           "final_layer.adaLN_modulation.1.weight": swap(sd.pop("norm_out.linear.weight")),
           "final_layer.adaLN_modulation.1.bias": swap(sd.pop("norm_out.linear.bias"))}
    for new, old in (("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
                     ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
                     ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
                     ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2")):
        for kind in ("weight", "bias"):
            out[f"{new}.{kind}"] = sd.pop(f"{old}.{kind}")
    for i in range(num_layers):
        b, j, last = f"transformer_blocks.{i}", f"joint_blocks.{i}", i == num_layers - 1
        for kind in ("weight", "bias"):
            out[f"{j}.x_block.attn.qkv.{kind}"] = torch.cat([sd.pop(f"{b}.attn.to_{x}.{kind}") for x in "qkv"])
            out[f"{j}.context_block.attn.qkv.{kind}"] = torch.cat(
                [sd.pop(f"{b}.attn.add_{x}_proj.{kind}") for x in "qkv"])
            renames = {"attn.to_out.0": "x_block.attn.proj", "norm1.linear": "x_block.adaLN_modulation.1",
                       "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
                       "norm1_context.linear": "context_block.adaLN_modulation.1"}
            if not last:
                renames.update({"attn.to_add_out": "context_block.attn.proj",
                                "ff_context.net.0.proj": "context_block.mlp.fc1",
                                "ff_context.net.2": "context_block.mlp.fc2"})
            for new_name, old_name in renames.items():
                value = sd.pop(f"{b}.{new_name}.{kind}")
                out[f"{j}.{old_name}.{kind}"] = swap(value) if last and new_name == "norm1_context.linear" else value
    if sd:
        raise ValueError(f"tensors left unconverted: {sorted(sd)[:5]}")
    return out
