"""Tiny random LoRA adapters for the tiny pipelines, written in the layouts people ship.

`random_lora` draws PEFT-named factors for a component's modules; `save_diffusers_lora` writes
them with the pipeline class's own ``save_lora_weights`` (LoRA config in the metadata, as
diffusers' training scripts do); the ``to_*`` functions re-lay the same adapter out in a
non-diffusers format that diffusers' ``lora_state_dict`` converts back:

| function | layout | families |
|---|---|---|
| `to_kohya_unet` | kohya / A1111 ``lora_unet_*`` / ``lora_te*_``, ``.alpha`` | SD 1.x/2.x, SDXL |
| `to_kohya_flux` | kohya BFL ``lora_unet_double_blocks_*`` (fused qkv / linear1) + ``lora_te1_`` | Flux, Flux Kontext |
| `to_sai_sd3` | kohya ``lora_unet_joint_blocks_*`` (fused qkv), ``lora_te1/2_``; ComfyUI ``diffusion_model.*`` | SD3 |
| `to_onetrainer` | OneTrainer ``lora_transformer_*``, SimpleTuner ``lycoris_*`` (diffusers names), ``.alpha`` | SD3 |
| `to_musubi_wan` | musubi-tuner ``lora_unet_blocks_*`` (Wan's original names), ``.alpha`` | Wan |
| `to_diffusion_model` | ComfyUI / ai-toolkit ``diffusion_model.*`` | Qwen-Image(-Edit) |

`diffusers_reference` loads adapters into a plain diffusers pipeline with ``load_lora_weights``
(the parity reference). transformers 5.24's ``load_adapter`` (what diffusers calls for text
encoders) refuses peft 0.21.2 by a version check alone (it asks for 0.22, which the package index
does not have); the reference lifts that check, nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: One adapter part: a component's PEFT-named state dict, its rank and lora_alpha.
Part = tuple[dict[str, torch.Tensor], int, float]


def random_lora(model: torch.nn.Module, targets: tuple[str, ...], rank: int, seed: int, std: float = 0.2,
                conv: bool = False, skip: tuple[str, ...] = (), bias: bool = False) -> dict[str, torch.Tensor]:
    """``{path.lora_A.weight, path.lora_B.weight}`` for every ``nn.Linear`` (and with `conv`,
    ``nn.Conv2d``) of `model` whose name ends with one of `targets` and matches none of the
    regular expressions `skip` (``lora_A`` ~ N(0, 1/in), ``lora_B`` ~ N(0, std)); conv factors as
    PEFT shapes them (A: base kernel, B: 1x1); with `bias`, ``lora_B.bias`` too (PEFT
    ``lora_bias=True``)."""
    import re

    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        if not path.endswith(targets) or any(re.search(pattern, path) for pattern in skip):
            continue
        if isinstance(module, torch.nn.Linear):
            a_shape, b_shape, fan_in = (rank, module.in_features), (module.out_features, rank), module.in_features
        elif conv and isinstance(module, torch.nn.Conv2d):
            k = tuple(module.kernel_size)
            a_shape, b_shape = (rank, module.in_channels, *k), (module.out_channels, rank, 1, 1)
            fan_in = module.in_channels * k[0] * k[1]
        else:
            continue
        out[f"{path}.lora_A.weight"] = torch.randn(a_shape, generator=g) / fan_in ** 0.5
        out[f"{path}.lora_B.weight"] = torch.randn(b_shape, generator=g) * std
        if bias:
            out[f"{path}.lora_B.bias"] = torch.randn(b_shape[0], generator=g) * std
    assert out, f"no module of {type(model).__name__} ends with {targets}"
    return out


def lora_config(state_dict: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, Any]:
    """The LoraConfig fields diffusers stores as adapter metadata."""
    targets = sorted({k.split(".lora_")[0] for k in state_dict})
    return {"r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "use_dora": False, "use_rslora": False, "init_lora_weights": True,
            "lora_bias": any(k.endswith("lora_B.bias") for k in state_dict)}


def save_diffusers_lora(pipe_cls: type, out: Path, parts: dict[str, Part]) -> Path:
    """`parts` (component -> (state dict, rank, alpha)) saved by ``pipe_cls.save_lora_weights``
    into folder `out` (``pytorch_lora_weights.safetensors``); returns `out`."""
    kwargs = {}
    for component, (state_dict, rank, alpha) in parts.items():
        kwargs[f"{component}_lora_layers"] = state_dict
        kwargs[f"{component}_lora_adapter_metadata"] = lora_config(state_dict, rank, alpha)
    pipe_cls.save_lora_weights(str(out), **kwargs)
    return out


def _pairs(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    modules = sorted({k.split(".lora_")[0] for k in state_dict})
    return {m: (state_dict[f"{m}.lora_A.weight"], state_dict[f"{m}.lora_B.weight"]) for m in modules}


def to_kohya_unet(parts: dict[str, Part]) -> dict[str, torch.Tensor]:
    """kohya / A1111 layout of an SD 1.x/2.x or SDXL adapter: ``lora_unet_<path with _>``,
    ``lora_te_`` (SD) or ``lora_te1_`` / ``lora_te2_`` (SDXL) for the text encoders, with
    ``lora_down`` / ``lora_up`` / ``alpha``."""
    two_encoders = "text_encoder_2" in parts
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_" if two_encoders else "lora_te_",
                "text_encoder_2": "lora_te2_"}
    out = {}
    for component, (state_dict, rank, alpha) in parts.items():
        for module, (a, b) in _pairs(state_dict).items():
            name = prefixes[component] + module.replace(".", "_")
            out[f"{name}.lora_down.weight"] = a.contiguous()
            out[f"{name}.lora_up.weight"] = b.contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def _block_diagonal(pairs: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One LoRA on a fused projection equal to separate ones on its output slices: A stacked,
    B block-diagonal (scale baked into B)."""
    down = torch.cat([a for a, _ in pairs])
    up = torch.block_diag(*[b * scale for _, b in pairs])
    return down, up


def to_kohya_flux(parts: dict[str, Part], num_double: int, num_single: int) -> dict[str, torch.Tensor]:
    """kohya layout of a Flux adapter in BFL's module names (``double_blocks.i.img_attn.qkv``,
    ``single_blocks.i.linear2`` ...), q/k/v fused into one projection as BFL's checkpoints have
    them; ``alpha`` = the fused rank (the diffusers scaling is baked into ``lora_up``). The
    adapter must cover all of a fused projection's parts. Single blocks' fused ``linear1``
    (q, k, v, MLP in) is left out: diffusers splits it by FLUX.1's real widths (3072 / 12288)."""
    out: dict[str, torch.Tensor] = {}

    def put(name: str, down: torch.Tensor, up: torch.Tensor) -> None:
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))

    state_dict, rank, alpha = parts["transformer"]
    p = _pairs(state_dict)
    s = alpha / rank
    for i in range(num_double):
        b = f"transformer_blocks.{i}"
        put(f"lora_unet_double_blocks_{i}_img_attn_qkv",
            *_block_diagonal([p[f"{b}.attn.to_q"], p[f"{b}.attn.to_k"], p[f"{b}.attn.to_v"]], s))
        put(f"lora_unet_double_blocks_{i}_txt_attn_qkv",
            *_block_diagonal([p[f"{b}.attn.add_q_proj"], p[f"{b}.attn.add_k_proj"], p[f"{b}.attn.add_v_proj"]], s))
        for src, dst in (("attn.to_out.0", "img_attn_proj"), ("attn.to_add_out", "txt_attn_proj"),
                         ("ff.net.0.proj", "img_mlp_0"), ("ff.net.2", "img_mlp_2"),
                         ("ff_context.net.0.proj", "txt_mlp_0"), ("ff_context.net.2", "txt_mlp_2")):
            if f"{b}.{src}" in p:
                put(f"lora_unet_double_blocks_{i}_{dst}", *_block_diagonal([p[f"{b}.{src}"]], s))
    for i in range(num_single):
        b = f"single_transformer_blocks.{i}"
        if f"{b}.proj_out" in p:
            put(f"lora_unet_single_blocks_{i}_linear2", *_block_diagonal([p[f"{b}.proj_out"]], s))
    if "text_encoder" in parts:
        te_sd, te_rank, te_alpha = parts["text_encoder"]
        for module, (a, b) in _pairs(te_sd).items():
            name = "lora_te1_" + module.replace(".", "_")
            out[f"{name}.lora_down.weight"] = a.contiguous()
            out[f"{name}.lora_up.weight"] = b.contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(te_alpha))
    return out


#: SD3: diffusers module (inside ``transformer_blocks.{i}``, or top-level) -> Stability AI's name
_SD3_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn2.to_out.0": "x_block.attn2.proj",
              "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
              "norm1.linear": "x_block.adaLN_modulation.1", "attn.to_add_out": "context_block.attn.proj",
              "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2",
              "norm1_context.linear": "context_block.adaLN_modulation.1"}
_SD3_FUSED = {("attn.to_q", "attn.to_k", "attn.to_v"): "x_block.attn.qkv",
              ("attn2.to_q", "attn2.to_k", "attn2.to_v"): "x_block.attn2.qkv",
              ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"): "context_block.attn.qkv"}
_SD3_TOP = {"context_embedder": "context_embedder", "pos_embed.proj": "x_embedder.proj",
            "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
            "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
            "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
            "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
            "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1"}


def to_sai_sd3(parts: dict[str, Part], num_blocks: int, comfy: bool = False) -> dict[str, torch.Tensor]:
    """An SD3 adapter in Stability AI's module names (``joint_blocks.{i}.x_block.attn.qkv`` ...):
    kohya sd-scripts layout (``lora_unet_`` / ``lora_te1_`` / ``lora_te2_``, ``lora_down`` /
    ``lora_up`` / ``alpha``), or with `comfy` the ComfyUI one (``diffusion_model.``, ``lora_A`` /
    ``lora_B`` with the scale baked into ``lora_B``, no alpha, no text encoders).

    q/k/v are one fused projection there: when the three ``lora_A`` are equal, one shared down
    and the ``lora_B`` stacked (kohya's usual form), otherwise the ``lora_A`` stacked and
    ``lora_B`` block-diagonal (sd-scripts' ``split_qkv`` form); alpha is set so that kohya's
    ``alpha / rank`` is the adapter's scale. The last block's ``norm1_context`` and ``norm_out``
    hold (scale, shift) in diffusers and (shift, scale) in SAI: ``lora_B``'s halves are swapped."""
    import re

    state_dict, rank, alpha = parts["transformer"]
    p = _pairs(state_dict)
    s = alpha / rank
    out: dict[str, torch.Tensor] = {}

    def put(name: str, down: torch.Tensor, up: torch.Tensor, swap: bool = False) -> None:
        if swap:
            shift_half, scale_half = up.chunk(2)
            up = torch.cat([scale_half, shift_half])
        if comfy:
            out[f"diffusion_model.{name}.lora_A.weight"] = down.contiguous()
            out[f"diffusion_model.{name}.lora_B.weight"] = (up * s).contiguous()
        else:
            key = "lora_unet_" + name.replace(".", "_")
            out[f"{key}.lora_down.weight"] = down.contiguous()
            out[f"{key}.lora_up.weight"] = up.contiguous()
            out[f"{key}.alpha"] = torch.tensor(s * down.shape[0])

    done = set()
    for module, (a, b) in p.items():
        if module in _SD3_TOP:
            put(_SD3_TOP[module], a, b, swap=module == "norm_out.linear")
            done.add(module)
            continue
        match = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module)
        assert match, f"no SAI name for {module}"
        i, rest = int(match.group(1)), match.group(2)
        if rest in _SD3_BLOCK:
            swap = rest == "norm1_context.linear" and i == num_blocks - 1
            put(f"joint_blocks.{i}.{_SD3_BLOCK[rest]}", a, b, swap=swap)
            done.add(module)
        for group, name in _SD3_FUSED.items():
            if rest == group[0]:
                members = [p[f"transformer_blocks.{i}.{m}"] for m in group]  # KeyError: q/k/v must all be there
                if all(torch.equal(members[0][0], m[0]) for m in members):
                    put(f"joint_blocks.{i}.{name}", members[0][0], torch.cat([m[1] for m in members]))
                else:
                    put(f"joint_blocks.{i}.{name}", torch.cat([m[0] for m in members]),
                        torch.block_diag(*[m[1] for m in members]))
                done |= {f"transformer_blocks.{i}.{m}" for m in group}
    assert done == set(p), f"no SAI name for {sorted(set(p) - done)}"
    if not comfy:
        for component, prefix in (("text_encoder", "lora_te1_"), ("text_encoder_2", "lora_te2_")):
            if component in parts:
                te_sd, _, te_alpha = parts[component]
                for module, (a, b) in _pairs(te_sd).items():
                    name = prefix + module.replace(".", "_")
                    out[f"{name}.lora_down.weight"] = a.contiguous()
                    out[f"{name}.lora_up.weight"] = b.contiguous()
                    out[f"{name}.alpha"] = torch.tensor(float(te_alpha))
    return out


def to_onetrainer(parts: dict[str, Part], prefix: str = "lora_transformer_") -> dict[str, torch.Tensor]:
    """OneTrainer layout of a transformer adapter (`prefix` ``lycoris_``: SimpleTuner's LyCORIS
    LoRA): ``<prefix><diffusers path with _>.lora_down/lora_up.weight`` and ``.alpha``."""
    state_dict, _, alpha = parts["transformer"]
    out = {}
    for module, (a, b) in _pairs(state_dict).items():
        name = prefix + module.replace(".", "_")
        out[f"{name}.lora_down.weight"] = a.contiguous()
        out[f"{name}.lora_up.weight"] = b.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def to_musubi_wan(parts: dict[str, Part], num_blocks: int) -> dict[str, torch.Tensor]:
    """musubi-tuner layout of a Wan adapter (Wan's original module names: ``self_attn.q``,
    ``cross_attn.o``, ``ffn.0`` ...), ``lora_down`` / ``lora_up`` / ``alpha``. The converter
    wants every block's q/k/v/o of both attentions and both FFN layers."""
    state_dict, rank, alpha = parts["transformer"]
    p = _pairs(state_dict)
    names = {"attn1.to_q": "self_attn_q", "attn1.to_k": "self_attn_k", "attn1.to_v": "self_attn_v",
             "attn1.to_out.0": "self_attn_o", "attn2.to_q": "cross_attn_q", "attn2.to_k": "cross_attn_k",
             "attn2.to_v": "cross_attn_v", "attn2.to_out.0": "cross_attn_o", "ffn.net.0.proj": "ffn_0",
             "ffn.net.2": "ffn_2"}
    out = {}
    for i in range(num_blocks):
        for src, dst in names.items():
            a, b = p[f"blocks.{i}.{src}"]
            name = f"lora_unet_blocks_{i}_{dst}"
            out[f"{name}.lora_down.weight"] = a.contiguous()
            out[f"{name}.lora_up.weight"] = b.contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def to_diffusion_model(parts: dict[str, Part]) -> dict[str, torch.Tensor]:
    """ComfyUI / ai-toolkit layout: ``diffusion_model.<diffusers path>.lora_A/B.weight`` with the
    diffusers scaling baked into ``lora_B`` (these files carry no alpha)."""
    state_dict, rank, alpha = parts["transformer"]
    out = {}
    for module, (a, b) in _pairs(state_dict).items():
        out[f"diffusion_model.{module}.lora_A.weight"] = a.contiguous()
        out[f"diffusion_model.{module}.lora_B.weight"] = (b * (alpha / rank)).contiguous()
    return out


def save_file_lora(state_dict: dict[str, torch.Tensor], path: Path) -> Path:
    """Write `state_dict` as a safetensors file; returns `path`."""
    save_file(state_dict, str(path))
    return path


def allow_transformers_peft() -> None:
    """Lift transformers' peft >= 0.22 version check (see the module docstring)."""
    import transformers.integrations.peft as transformers_peft

    transformers_peft.check_peft_version = lambda min_version: None


def diffusers_reference(pipe: Any, adapters: dict[str, Path], active: dict[str, float]) -> Any:
    """`pipe` with `adapters` (name -> file or folder) loaded by its ``load_lora_weights`` and
    ``set_adapters(list(active), list(active.values()))`` (``disable_lora`` when `active` is
    empty). Adapters already loaded are not loaded again."""
    allow_transformers_peft()
    loaded = {a for names in pipe.get_list_adapters().values() for a in names}
    for name, path in adapters.items():
        if name not in loaded:
            pipe.load_lora_weights(str(path), adapter_name=name)
    if active:
        pipe.enable_lora()
        pipe.set_adapters(list(active), list(active.values()))
    else:
        pipe.disable_lora()
    return pipe

