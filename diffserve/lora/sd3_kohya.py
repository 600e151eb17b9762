"""SD3 / SD3.5 LoRA files in Stability AI's original module names, converted to diffusers'
``SD3Transformer2DModel`` names: the one layout diffusers 0.42 reads for other families but not
for SD3 (``SD3LoraLoaderMixin.lora_state_dict`` converts nothing), hence hand-written here.

Layouts (SAI names: ``joint_blocks.{i}.{x_block,context_block}.{attn.qkv, attn.proj, attn2.qkv,
attn2.proj, mlp.fc1, mlp.fc2, adaLN_modulation.1}``, ``context_embedder``, ``x_embedder.proj``,
``t_embedder.mlp.{0,2}``, ``y_embedder.mlp.{0,2}``, ``final_layer.{linear, adaLN_modulation.1}``):

- kohya sd-scripts (``networks/lora_sd3.py``): ``lora_unet_<SAI name, dots as _>.lora_down.weight``
  / ``.lora_up.weight`` / ``.alpha``; text encoders ``lora_te1_`` (CLIP-L, ``text_encoder``),
  ``lora_te2_`` (CLIP-G, ``text_encoder_2``), ``lora_te3_`` (T5, which diffusers loads no LoRA
  into: such modules stay unmatched and the file is refused by the caller);
- ComfyUI / SAI: ``diffusion_model.<SAI name>.lora_down/lora_up`` (``.alpha``) or
  ``.lora_A/lora_B`` (no alpha: scale 1);
- OneTrainer (``lora_transformer_``) and SimpleTuner's LyCORIS LoRA (``lycoris_``): diffusers'
  module names with dots as ``_``, kohya factors and alpha (ComfyUI reads both for SD3).

Semantics mirror diffusers' kohya Flux converter (``_convert_kohya_flux_lora_to_diffusers``):
kohya's scale ``alpha / rank`` (alpha defaults to the rank) is baked into the factors; a fused
q/k/v LoRA (one ``lora_down`` (r, in) shared by q, k and v, ``lora_up`` (3 * out, r)) becomes three
LoRAs with that shared ``A`` and ``B`` split by rows, or, when ``lora_up`` is block-diagonal
(sd-scripts' ``split_qkv``: r = 3 r'), three rank-r' LoRAs with ``A`` chunked. Module names
and the scale/shift order of the pre-only context block's and the final layer's adaLN
(``AdaLayerNormContinuous``, diffusers' ``swap_scale_shift`` on ``lora_up``'s rows) follow
diffusers' single-file converter ``convert_sd3_transformer_checkpoint_to_diffusers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: kohya prefixes of the denoiser and the text encoders, and the ComfyUI / SAI prefix.
KOHYA_UNET = "lora_unet_"
KOHYA_TEXT_ENCODERS = {"lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2"}
SAI = "diffusion_model."
#: Prefixes of kohya-style keys in diffusers' module names (OneTrainer, SimpleTuner LyCORIS).
DIFFUSERS_NAMED = ("lora_transformer_", "lycoris_")
#: Key prefixes that mark a file as one of these layouts (``lora_te3_`` so T5 parts are reported).
PREFIXES = (KOHYA_UNET, *KOHYA_TEXT_ENCODERS, "lora_te3_", SAI, *DIFFUSERS_NAMED)
#: File suffix -> (factor, PEFT suffix).
_SUFFIXES = {"lora_down.weight": "down", "lora_up.weight": "up", "lora_A.weight": "down",
             "lora_B.weight": "up", "alpha": "alpha"}


@dataclass(frozen=True)
class Target:
    """Where one SAI module's LoRA goes in diffusers.

    Attributes:
        paths: diffusers module paths in the transformer; several for a fused projection, whose
            output rows are theirs in order (q, k, v).
        swap: ``lora_up``'s two row halves are (shift, scale) in SAI, (scale, shift) in diffusers.
    """

    paths: tuple[str, ...]
    swap: bool = False


def applies(pipe: Any, keys: list[str]) -> bool:
    """Whether `pipe` has an ``SD3Transformer2DModel`` and the file `keys` use the SAI layouts."""
    from diffusers import SD3Transformer2DModel

    return isinstance(getattr(pipe, "transformer", None), SD3Transformer2DModel) \
        and any(k.startswith(PREFIXES) for k in keys)


def sai_targets(transformer: torch.nn.Module) -> dict[str, Target]:
    """SAI module name -> diffusers `Target`, for every SAI module `transformer` has (its
    blocks' dual attention, ``context_pre_only`` and count come from the model)."""
    names: dict[str, Target] = {
        "context_embedder": Target(("context_embedder",)),
        "x_embedder.proj": Target(("pos_embed.proj",)),
        "t_embedder.mlp.0": Target(("time_text_embed.timestep_embedder.linear_1",)),
        "t_embedder.mlp.2": Target(("time_text_embed.timestep_embedder.linear_2",)),
        "y_embedder.mlp.0": Target(("time_text_embed.text_embedder.linear_1",)),
        "y_embedder.mlp.2": Target(("time_text_embed.text_embedder.linear_2",)),
        "final_layer.linear": Target(("proj_out",)),
        "final_layer.adaLN_modulation.1": Target(("norm_out.linear",), swap=True),
    }
    for i, block in enumerate(transformer.transformer_blocks):
        sai, b = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        names[f"{sai}.x_block.attn.qkv"] = Target((f"{b}.attn.to_q", f"{b}.attn.to_k", f"{b}.attn.to_v"))
        names[f"{sai}.x_block.attn.proj"] = Target((f"{b}.attn.to_out.0",))
        names[f"{sai}.x_block.mlp.fc1"] = Target((f"{b}.ff.net.0.proj",))
        names[f"{sai}.x_block.mlp.fc2"] = Target((f"{b}.ff.net.2",))
        names[f"{sai}.x_block.adaLN_modulation.1"] = Target((f"{b}.norm1.linear",))
        if getattr(block, "attn2", None) is not None:  # SD3.5 medium: dual attention in the x block
            names[f"{sai}.x_block.attn2.qkv"] = Target((f"{b}.attn2.to_q", f"{b}.attn2.to_k", f"{b}.attn2.to_v"))
            names[f"{sai}.x_block.attn2.proj"] = Target((f"{b}.attn2.to_out.0",))
        names[f"{sai}.context_block.attn.qkv"] = Target(
            (f"{b}.attn.add_q_proj", f"{b}.attn.add_k_proj", f"{b}.attn.add_v_proj"))
        pre_only = bool(getattr(block, "context_pre_only", False))
        names[f"{sai}.context_block.adaLN_modulation.1"] = Target((f"{b}.norm1_context.linear",), swap=pre_only)
        if not pre_only:
            names[f"{sai}.context_block.attn.proj"] = Target((f"{b}.attn.to_add_out",))
            names[f"{sai}.context_block.mlp.fc1"] = Target((f"{b}.ff_context.net.0.proj",))
            names[f"{sai}.context_block.mlp.fc2"] = Target((f"{b}.ff_context.net.2",))
    return {name: t for name, t in names.items() if all(_has(transformer, p) for p in t.paths)}


def to_diffusers(state_dict: dict[str, torch.Tensor], pipe: Any) -> dict[str, torch.Tensor]:
    """Convert an SAI-layout SD3 LoRA state dict to diffusers / PEFT keys for `pipe`.

    Args:
        state_dict: the file's tensors (see the module docstring for the layouts): per module
            ``lora_down`` (r, in) or (r, in, kh, kw), ``lora_up`` (out, r) or (out, r, 1, 1),
            optional scalar ``alpha``; any float dtype (kept).
        pipe: the SD3 pipeline (or its weightless skeleton): ``transformer`` gives module names
            and output widths, ``text_encoder`` / ``text_encoder_2`` the CLIP module names.

    Returns:
        ``{component}.{module path}.lora_A.weight`` / ``.lora_B.weight`` with kohya's
        ``alpha / rank`` baked in (so diffusers' own loader sees scale 1). Modules of no known
        name (other models' blocks, ``lora_te3_`` T5 parts, other prefixes) keep their keys,
        alphas dropped, so the caller's match check reports them as unmatched.

    Raises:
        ValueError: a known module's ``lora_up`` rows do not fit its diffusers modules, or its
            ``lora_down`` / ``lora_up`` is missing.
    """
    transformer = pipe.transformer
    targets = sai_targets(transformer)
    by_underscores = {name.replace(".", "_"): name for name in targets}
    diffusers_names = {p.replace(".", "_"): p for p, m in transformer.named_modules()
                       if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    encoders = {prefix: (component, _linear_names(getattr(pipe, component, None)))
                for prefix, component in KOHYA_TEXT_ENCODERS.items()}

    groups: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[str, list[str]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        split = _split(key)
        if split is None:
            out[key] = value
        else:
            groups.setdefault(split[0], {})[split[1]] = value
            keys.setdefault(split[0], []).append(key)

    for module, factors in groups.items():
        resolved = _resolve(module, targets, by_underscores, diffusers_names, encoders)
        if resolved is None:  # unknown: passed through for the match check, alpha dropped
            out.update({k: state_dict[k] for k in keys[module] if not k.endswith(".alpha")})
            continue
        if "down" not in factors or "up" not in factors:
            raise ValueError(f"{module}: needs both lora_down and lora_up (has {sorted(factors)})")
        down, up = _baked(factors)
        component, target = resolved
        if component != "transformer":
            out[f"{component}.{target.paths[0]}.lora_A.weight"] = down
            out[f"{component}.{target.paths[0]}.lora_B.weight"] = up
            continue
        widths = [transformer.get_submodule(p).weight.shape[0] for p in target.paths]
        if up.shape[0] != sum(widths):
            raise ValueError(f"{module}: lora_up has {up.shape[0]} output rows, {' + '.join(target.paths)} have "
                             f"{' + '.join(map(str, widths))}")
        if target.swap:
            from diffusers.loaders.lora_conversion_utils import swap_scale_shift

            up = swap_scale_shift(up)
        for path, (a, b) in zip(target.paths, _split_fused(down, up, widths)):
            out[f"transformer.{path}.lora_A.weight"] = a
            out[f"transformer.{path}.lora_B.weight"] = b
    return out


def _has(root: torch.nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _linear_names(module: torch.nn.Module | None) -> dict[str, str]:
    """``{path with _: path}`` of `module`'s linear layers (kohya's text-encoder names), also
    under kohya's ``text_model_`` prefix where the model has no ``text_model`` level."""
    if module is None:
        return {}
    names = {}
    for path, m in module.named_modules():
        if isinstance(m, torch.nn.Linear):
            names[path.replace(".", "_")] = path
            if not path.startswith("text_model."):
                names["text_model_" + path.replace(".", "_")] = path
    return names


def _split(key: str) -> tuple[str, str] | None:
    """(module name, factor kind) of a LoRA key, or None when the suffix is none of the layouts'."""
    for suffix, kind in _SUFFIXES.items():
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], kind
    return None


def _resolve(module: str, targets: dict[str, Target], by_underscores: dict[str, str], diffusers_names: dict[str, str],
             encoders: dict[str, tuple[str, dict[str, str]]]) -> tuple[str, Target] | None:
    """(component, target) of a file's module name, or None when it names nothing known."""
    for prefix in DIFFUSERS_NAMED:
        if module.startswith(prefix):
            path = diffusers_names.get(module[len(prefix):])
            return ("transformer", Target((path,))) if path is not None else None
    if module.startswith(KOHYA_UNET):
        name = by_underscores.get(module[len(KOHYA_UNET):])
        return ("transformer", targets[name]) if name is not None else None
    if module.startswith(SAI):
        name = module[len(SAI):]
        return ("transformer", targets[name]) if name in targets else None
    for prefix, (component, names) in encoders.items():
        if module.startswith(prefix) and module[len(prefix):] in names:
            return component, Target((names[module[len(prefix):]],))
    return None


def _baked(factors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) with kohya's ``alpha / rank`` multiplied in, split between the two factors
    as diffusers' kohya converters do (both stay in range in half precision)."""
    down, up = factors["down"], factors["up"]
    rank = down.shape[0]
    alpha = float(factors["alpha"].item()) if "alpha" in factors else float(rank)
    scale_down, scale_up = alpha / rank, 1.0
    while scale_down * 2 < scale_up:
        scale_down *= 2
        scale_up /= 2
    return down * scale_down, up * scale_up


def _split_fused(down: torch.Tensor, up: torch.Tensor, widths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per output slice (rows `widths` of `up`), its (A, B): the shared ``down`` and the slice's
    rows of ``up``; or, when ``up`` is block-diagonal over `widths` (rank divisible by their
    count), the matching chunk of ``down`` and the diagonal block (the smaller, equal update)."""
    if len(widths) == 1:
        return [(down.contiguous(), up.contiguous())]
    n, rank = len(widths), down.shape[0]
    rows = torch.split(up, widths, dim=0)
    if rank % n == 0:
        r = rank // n
        blocks = [row.reshape(row.shape[0], n, r, *row.shape[2:]) for row in rows]
        off_diagonal = [torch.cat([blk[:, :j], blk[:, j + 1:]], dim=1) for j, blk in enumerate(blocks)]
        if all(torch.count_nonzero(off) == 0 for off in off_diagonal):
            downs = torch.chunk(down, n, dim=0)
            return [(downs[j].contiguous(), blk[:, j].contiguous()) for j, blk in enumerate(blocks)]
    return [(down.contiguous(), row.contiguous()) for row in rows]
