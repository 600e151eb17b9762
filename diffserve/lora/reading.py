"""Read a LoRA file in any format diffusers reads into a `LoraAdapter`, through diffusers' own
loader, without touching the served model.

Formats: diffusers (``save_lora_weights``: ``pytorch_lora_weights.safetensors``, a file or its
folder), PEFT folders (``adapter_model.safetensors`` + ``adapter_config.json``), and every
non-diffusers layout the pipeline class's ``lora_state_dict`` converts (kohya / A1111
``lora_unet_*`` / ``lora_te*`` with ``.alpha``, ComfyUI / ai-toolkit ``diffusion_model.*``, XLabs
Flux, BFL Flux, musubi Wan, ...): whatever diffusers 0.42 converts for that family; and SD3's kohya
/ ComfyUI files in Stability AI's module names, which diffusers does not convert, through
`diffserve.lora.sd3_kohya` before diffusers' loader.

How: the pipeline's LoRA-loadable components (denoiser, text encoders) are rebuilt from their
configs on the ``meta`` device (no memory), the pipeline class's own ``load_lora_weights`` runs on
that skeleton, and the PEFT layers it injected are read back: per module ``lora_A``, ``lora_B``
and PEFT's ``scaling`` (so alpha, rank patterns, rsLoRA and kohya ``.alpha`` mean exactly what
they mean in diffusers). Text-encoder parts go through diffusers' key conversion and
``_create_lora_config`` and are injected with PEFT's ``inject_adapter_in_model`` +
``set_peft_model_state_dict``: transformers 5.24's ``load_adapter`` (which diffusers calls) needs
peft >= 0.22, whose weight-conversion module it imports.

A file whose LoRA modules match nothing of the loaded model, or only part of it, is refused
with the counts and examples; so are adapter kinds the per-row math cannot add (DoRA, LoKr,
LoHa, embedding LoRA, full-weight patches).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from diffserve.core.errors import InvalidRequestError
from diffserve.lora import sd3_kohya
from diffserve.lora.weights import LoraAdapter, LoraModule

logger = logging.getLogger(__name__)

#: Adapter name used inside the skeleton (never visible to users).
_SKELETON_ADAPTER = "diffserve"
#: Unmatched module names a refusal shows.
_EXAMPLES = 3
#: Substrings of keys of adapter kinds the per-row math does not add (DoRA magnitudes,
#: LyCORIS LoKr / LoHa factors, full-weight diffs).
_UNSUPPORTED_KEYS = {
    "dora_scale": "DoRA (weight-decomposed LoRA)",
    "lora_magnitude_vector": "DoRA (weight-decomposed LoRA)",
    "lokr_": "LoKr (LyCORIS Kronecker adapter)",
    "hada_": "LoHa (LyCORIS Hadamard adapter)",
    ".diff": "a full-weight difference patch",
    ".diff_b": "a full-weight difference patch",
}


class LoraFileError(InvalidRequestError):
    """A LoRA file cannot be served: missing, unreadable, of an unsupported kind, or not
    matching the loaded model (``field`` is ``"path"``)."""

    def __init__(self, path: Any, allowed: str, detail: str | None = None):
        super().__init__("path", str(path), allowed, detail)

    def __reduce__(self):
        return (type(self), (self.value, self.allowed, self.detail))


def read_lora(source: str | Path, pipe: Any, name: str) -> LoraAdapter:
    """Read the LoRA at `source` for the diffusers pipeline `pipe` (the served model).

    Args:
        source: a ``.safetensors`` file, a diffusers ``save_lora_weights`` folder, or a PEFT
            folder (``adapter_config.json`` + ``adapter_model.safetensors``). Pickle files
            (``.bin``, ``.pt``) are refused: loading them runs arbitrary code.
        pipe: the loaded pipeline (its class's diffusers LoRA loader and its components'
            configs are used; its modules are only read).
        name: the adapter's name.

    Returns:
        The adapter, its tensors on the CPU in the file's dtype.

    Raises:
        LoraFileError: (field ``path``) the path does not exist or is not a safetensors LoRA;
            the pipeline class has no diffusers LoRA loader; the file holds an unsupported
            adapter kind; or its LoRA modules match none / only part of the model (the message
            gives matched and unmatched counts and unmatched examples).
    """
    path = Path(source)
    if not path.exists():
        raise LoraFileError(source, "an existing LoRA .safetensors file or folder")
    if path.is_file() and path.suffix != ".safetensors":
        raise LoraFileError(source, "a .safetensors file (pickle formats such as .bin / .pt run code when loaded)")
    loader = type(pipe)
    if not getattr(loader, "_lora_loadable_modules", None):
        raise LoraFileError(source, f"a LoRA for a pipeline with a diffusers LoRA loader ({loader.__name__} has none)")
    peft_config = path / "adapter_config.json" if path.is_dir() else None
    is_peft = peft_config is not None and peft_config.is_file()
    _refuse_unsupported_kinds(path, peft_weights=is_peft)
    skeleton = _skeleton(pipe)
    captured: dict[str, torch.Tensor] = {}
    try:
        if is_peft:
            fmt = "peft"
            captured = _load_peft_folder(skeleton, path)
        else:
            fmt = _load_through_diffusers(skeleton, path, captured)
    except LoraFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - any library error is a refusal of this file
        cause = f"{type(exc).__name__}: {exc}"
        if captured:  # converted, but PEFT found (some) modules missing: say how many matched
            try:
                partial = _extract(skeleton, source)
            except LoraFileError:
                partial = {}
            _check_matches(source, pipe, captured, partial, cause=cause)
        raise LoraFileError(source, f"a LoRA file diffusers can load into {loader.__name__}", detail=cause) from exc
    modules = _extract(skeleton, source)
    _check_matches(source, pipe, captured, modules)
    _check_live_modules(source, pipe, modules)
    return LoraAdapter(name=name, source=str(source), modules=modules, format=fmt)


# ------------------------------------------------------------------------- the skeleton
def loadable_components(pipe: Any) -> list[str]:
    """Names of `pipe`'s components diffusers loads LoRA into that are present (modules)."""
    return [c for c in getattr(type(pipe), "_lora_loadable_modules", [])
            if isinstance(getattr(pipe, c, None), torch.nn.Module)]


def _skeleton(pipe: Any) -> Any:
    """A pipeline of `pipe`'s class whose LoRA-loadable components are fresh ``meta``-device
    copies (same configs, no memory) and whose other modules are None (diffusers' offload
    checks then never see the live modules); schedulers, tokenizers and processors are shared."""
    loadable = set(loadable_components(pipe))
    parts: dict[str, Any] = {}
    for key, value in pipe.components.items():
        if key in loadable:
            parts[key] = _meta_copy(value)
        elif isinstance(value, torch.nn.Module):
            parts[key] = None
        else:
            parts[key] = value
    skeleton = type(pipe)(**parts)
    # text encoders: diffusers' path needs transformers' load_adapter (peft >= 0.22); see module docstring
    skeleton.load_lora_into_text_encoder = text_encoder_loader(skeleton)
    return skeleton


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """`module`'s class built from its config on the meta device, every parameter and buffer
    then replaced by a CPU tensor of its shape and dtype that holds one element (stride 0):
    PEFT moves each adapter to its base layer's device, which must not be ``meta``."""
    with torch.device("meta"):
        if hasattr(type(module), "from_config") and not hasattr(module, "_from_config"):
            copy = type(module).from_config(module.config)  # diffusers ModelMixin
        else:
            copy = type(module)(module.config)  # transformers PreTrainedModel
    for sub in copy.modules():
        for key, param in sub._parameters.items():
            if param is not None:
                sub._parameters[key] = torch.nn.Parameter(_placeholder(param), requires_grad=False)
        for key, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[key] = _placeholder(buffer)
    return copy


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like `tensor` whose every element is one stored zero."""
    return torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)


def text_encoder_loader(pipe: Any):
    """diffusers' ``load_lora_into_text_encoder`` (``lora_base._load_lora_into_text_encoder``)
    with PEFT's injection in place of transformers' ``load_adapter`` (which needs peft >= 0.22),
    for `pipe` (set as its ``load_lora_into_text_encoder``)."""
    skeleton = pipe
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft
    from diffusers.utils.peft_utils import _create_lora_config
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    def load(state_dict, network_alphas=None, text_encoder=None, prefix=None, lora_scale=1.0,
             adapter_name=None, metadata=None, **_ignored):
        prefix = prefix or getattr(skeleton, "text_encoder_name", "text_encoder")
        state_dict = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
        if metadata is not None:
            metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
        if not state_dict or text_encoder is None:
            return
        state_dict = convert_state_dict_to_peft(convert_state_dict_to_diffusers(state_dict))
        if not hasattr(text_encoder, "text_model"):  # CLIP flattened in transformers 5
            state_dict = {k.removeprefix("text_model."): v for k, v in state_dict.items()}
        rank = {}
        for module_name, _ in text_encoder.named_modules():
            key = f"{module_name}.lora_B.weight"
            if module_name.endswith((".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")) and key in state_dict:
                rank[key] = state_dict[key].shape[1]
        if network_alphas is not None:
            network_alphas = {k.removeprefix(f"{prefix}."): v for k, v in network_alphas.items()
                              if k.startswith(prefix) and k.split(".")[0] == prefix}
        config = _create_lora_config(state_dict, network_alphas, metadata, rank, is_unet=False)
        inject_adapter_in_model(config, text_encoder, adapter_name=adapter_name, state_dict=state_dict,
                                low_cpu_mem_usage=True)
        set_peft_model_state_dict(text_encoder, state_dict, adapter_name, low_cpu_mem_usage=True)
        if lora_scale != 1.0:
            from diffusers.utils import scale_lora_layers

            scale_lora_layers(text_encoder, weight=lora_scale)

    return load


# ------------------------------------------------------------------------- loading
def _load_through_diffusers(skeleton: Any, path: Path, captured: dict[str, torch.Tensor]) -> str:
    """The pipeline class's ``load_lora_weights`` on the skeleton; `captured` receives the
    converted state dict (diffusers names) it loads. Returns the detected source format."""
    original = type(skeleton).lora_state_dict
    seen: dict[str, Any] = {}

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        state_dict = out[0] if isinstance(out, tuple) else out
        captured.update(state_dict)
        return out

    raw_keys = _file_keys(path)
    seen["format"] = _format_of(raw_keys)
    source: str | dict[str, torch.Tensor] = str(path)
    if sd3_kohya.applies(skeleton, raw_keys):  # the one layout diffusers 0.42 does not convert
        raw = type(skeleton).lora_state_dict(str(path), use_safetensors=True, local_files_only=True)
        source = sd3_kohya.to_diffusers(raw, skeleton)
    skeleton.lora_state_dict = capture
    skeleton.load_lora_weights(source, adapter_name=_SKELETON_ADAPTER, low_cpu_mem_usage=True,
                               use_safetensors=True, local_files_only=True)
    return seen["format"]


def _load_peft_folder(skeleton: Any, path: Path) -> dict[str, torch.Tensor]:
    """A PEFT folder (``PeftModel.save_pretrained`` of the denoiser): its weights with the
    ``base_model.model.`` prefix dropped, its ``adapter_config.json`` as the LoRA config
    (diffusers' ``metadata``), loaded by the denoiser's ``load_lora_adapter``."""
    from safetensors.torch import load_file

    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise LoraFileError(path, "a PEFT folder with adapter_model.safetensors (pickle .bin files are refused)")
    config = json.loads((path / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraFileError(path, "a LoRA adapter", detail=f"adapter_config.json says peft_type {config['peft_type']}")
    state_dict = {k.removeprefix("base_model.model."): v for k, v in load_file(str(weights)).items()}
    from peft import LoraConfig

    fields = set(LoraConfig.__dataclass_fields__)
    metadata = {k: v for k, v in config.items() if k in fields and k not in ("base_model_name_or_path", "revision",
                                                                            "task_type", "peft_type", "auto_mapping")}
    denoiser = _denoiser_component(skeleton)
    getattr(skeleton, denoiser).load_lora_adapter(state_dict, prefix=None, metadata=metadata,
                                                  adapter_name=_SKELETON_ADAPTER, low_cpu_mem_usage=True)
    return {f"{denoiser}.{k}": v for k, v in state_dict.items()}


def _denoiser_component(pipe: Any) -> str:
    """The first LoRA-loadable component that is not a text encoder (transformer / unet)."""
    for component in loadable_components(pipe):
        if not component.startswith("text_encoder"):
            return component
    raise LoraFileError("adapter_config.json", "a PEFT folder for a model with a denoiser")


def _file_keys(path: Path) -> list[str]:
    """Tensor names of a safetensors LoRA file or of the one diffusers picks in a folder."""
    from safetensors import safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    keys: list[str] = []
    for file in files[:1] if path.is_file() else files:
        try:
            with safe_open(str(file), framework="pt") as f:
                keys.extend(f.keys())
        except Exception as exc:  # noqa: BLE001
            raise LoraFileError(file, "a readable safetensors file", detail=str(exc)) from exc
    return keys


def _format_of(keys: list[str]) -> str:
    """A name for the file layout (for listings)."""
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya"
    if any(k.startswith(("diffusion_model.", "lora_transformer_")) or "processor" in k for k in keys):
        return "non-diffusers"
    return "diffusers"


def _refuse_unsupported_kinds(path: Path, peft_weights: bool) -> None:
    keys = _file_keys(path / "adapter_model.safetensors" if peft_weights else path)
    for marker, kind in _UNSUPPORTED_KEYS.items():
        hits = [k for k in keys if marker in k and not (marker.startswith(".diff") and not k.endswith(marker))]
        if hits:
            raise LoraFileError(path, "a plain LoRA (low-rank A/B factors)",
                                detail=f"it holds {kind} weights, e.g. {hits[0]!r}; per-row batching adds only "
                                       "low-rank LoRA deltas")


# ------------------------------------------------------------------------- reading back
def _extract(skeleton: Any, source: Any) -> dict[str, dict[str, LoraModule]]:
    """Per component, the PEFT LoRA layers the skeleton received, as `LoraModule`s."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, dict[str, LoraModule]] = {}
    for component in loadable_components(skeleton):
        found: dict[str, LoraModule] = {}
        for path, layer in getattr(skeleton, component).named_modules():
            if not isinstance(layer, LoraLayer) or _SKELETON_ADAPTER not in layer.lora_A:
                continue
            if _SKELETON_ADAPTER in getattr(layer, "lora_embedding_A", {}):
                raise LoraFileError(source, "a LoRA on linear and conv layers", detail=f"embedding LoRA on {path}")
            if layer.use_dora.get(_SKELETON_ADAPTER, False):
                raise LoraFileError(source, "a plain LoRA", detail=f"DoRA on {component}.{path}")
            a_layer, b_layer = layer.lora_A[_SKELETON_ADAPTER], layer.lora_B[_SKELETON_ADAPTER]
            module = LoraModule(a=a_layer.weight.detach(), b=b_layer.weight.detach(),
                                scaling=float(layer.scaling[_SKELETON_ADAPTER]),
                                bias=None if getattr(b_layer, "bias", None) is None else b_layer.bias.detach())
            if isinstance(a_layer, torch.nn.modules.conv._ConvNd):
                if a_layer.groups != 1 or b_layer.groups != 1 or a_layer.padding_mode != "zeros" \
                        or any(d != 1 for d in a_layer.dilation):
                    raise LoraFileError(source, "conv LoRA on ungrouped, zero-padded, undilated convs",
                                        detail=f"{component}.{path}")
                module.stride, module.padding = tuple(a_layer.stride), a_layer.padding
            elif not isinstance(a_layer, torch.nn.Linear):
                raise LoraFileError(source, "LoRA on linear and conv layers",
                                    detail=f"{type(a_layer).__name__} on {component}.{path}")
            if module.a.device.type == "meta":
                raise LoraFileError(source, "a LoRA whose every factor is in the file",
                                    detail=f"no weights were loaded for {component}.{path}")
            found[path] = module
        if found:
            out[component] = found
    return out


def _wanted_modules(captured: dict[str, torch.Tensor], components: list[str]) -> set[str]:
    """``component.module`` names of the LoRA keys of a converted state dict, after the key
    renames diffusers applies on loading (old ``to_q_lora.down`` / ``lora.down`` spellings to
    PEFT's), by diffusers' own rule in ``get_peft_kwargs`` (the name before ``.lora``), also
    for keys of no component."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, convert_unet_state_dict_to_peft

    by_component: dict[str, dict[str, Any]] = {}
    wanted: set[str] = set()
    for key in captured:
        if key.endswith(".alpha"):
            continue
        component = key.split(".", 1)[0]
        if component in components and "." in key:
            by_component.setdefault(component, {})[key.split(".", 1)[1]] = 0
        else:
            wanted.add(key.split(".lora")[0])
    for component, keys in by_component.items():
        if component.startswith("text_encoder"):
            keys = convert_state_dict_to_peft(convert_state_dict_to_diffusers(keys))
        elif not any("lora_A" in k for k in keys):
            keys = convert_unet_state_dict_to_peft(keys)
        wanted |= {f"{component}.{k.split('.lora')[0]}" for k in keys}
    return wanted


def _check_matches(source: Any, pipe: Any, captured: dict[str, torch.Tensor],
                   modules: dict[str, dict[str, LoraModule]], cause: str | None = None) -> None:
    """Refuse unless every LoRA module of the converted file landed on a model module (and
    nothing failed: `cause`)."""
    components = loadable_components(pipe)
    wanted = _wanted_modules(captured, components)
    loaded = {f"{c}.{p}" for c, mods in modules.items() for p in mods}
    loaded |= {f"{c}.text_model.{p}" for c, mods in modules.items() for p in mods}  # CLIP flattened keys
    unmatched = sorted(w for w in wanted if w not in loaded)
    matched = len(wanted) - len(unmatched)
    if not modules or unmatched or cause:
        examples = ", ".join(unmatched[:_EXAMPLES]) or "none"
        detail = f"{matched} of {len(wanted)} LoRA modules matched, {len(unmatched)} unmatched (e.g. {examples})"
        raise LoraFileError(
            source, f"a LoRA whose every module matches this model ({type(pipe).__name__}: "
                    f"{', '.join(components)})", detail=detail + (f"; {cause}" if cause else ""))


def _check_live_modules(source: Any, pipe: Any, modules: dict[str, dict[str, LoraModule]]) -> None:
    """Every adapted module exists in the served model with the factors' shapes."""
    for component, mods in modules.items():
        root = getattr(pipe, component)
        for path, m in mods.items():
            try:
                live = root.get_submodule(path)
            except AttributeError:
                raise LoraFileError(source, "a LoRA matching this model", detail=f"{component} has no module {path}")
            live = getattr(live, "base_layer", live)  # a module already wrapped by PEFT
            if m.is_conv:
                ok = isinstance(live, torch.nn.modules.conv._ConvNd) and live.in_channels == m.a.shape[1] \
                    and live.out_channels == m.b.shape[0] and tuple(live.kernel_size) == tuple(m.a.shape[2:])
            else:
                ok = isinstance(live, torch.nn.Linear) and live.in_features == m.a.shape[1] \
                    and live.out_features == m.b.shape[0]
            if not ok:
                raise LoraFileError(source, "a LoRA matching this model's layer shapes",
                                    detail=f"{component}.{path}: A {tuple(m.a.shape)}, B {tuple(m.b.shape)} vs "
                                           f"{type(live).__name__}")
