"""Quantize a loaded component's linear layers with torchao (and, for the int8 methods, its
token-embedding tables: `embedding`), keep named layers in full precision, and describe what a component holds (quantized here, pre-quantized in its folder, or
loaded from a GGUF file).
"""

from __future__ import annotations

import fnmatch
import logging
from collections import Counter
from collections.abc import Iterable

import torch

from diffserve.quantization.embedding import quantize_embeddings
from diffserve.quantization.methods import EMBEDDING_METHODS, can_quantize, torchao_config
from diffserve.core.quantization import ComponentReport
from diffserve.core.tensor_storage import is_wrapper, tensor_bytes

logger = logging.getLogger(__name__)


def is_quantized_tensor(t: torch.Tensor) -> bool:
    """Whether `t` is a quantized weight: a torchao tensor subclass (a wrapper whose data is
    in inner tensors) or a GGUF parameter (diffusers' ``GGUFParameter``)."""
    return is_wrapper(t) or type(t).__name__ == "GGUFParameter"


def linear_layers(module: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The ``torch.nn.Linear`` layers of `module` holding full-precision weights, by
    qualified name (relative to `module`), in module order."""
    return {name: m for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight is not None and not is_quantized_tensor(m.weight)}


def matches(component: str, layer: str, patterns: Iterable[str]) -> bool:
    """Whether a layer matches one of the skip `patterns` (shell-style wildcards, matched
    against ``component.layer`` and against the bare ``layer``)."""
    qualified = f"{component}.{layer}"
    return any(fnmatch.fnmatchcase(qualified, p) or fnmatch.fnmatchcase(layer, p) for p in patterns)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers (each tensor once), tensor subclasses counted
    by their real storage (`tensor_bytes`)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


def full_precision_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes `module`'s weights would take unquantized: quantized weights counted at their
    logical shape in `dtype`, the rest as they are."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * dtype.itemsize if is_quantized_tensor(t) else tensor_bytes(t)
    return total


def quantizable_layers(module: torch.nn.Module, method: str) -> dict[str, torch.nn.Linear]:
    """The linear layers `method` can quantize (see `methods.can_quantize`)."""
    return {n: m for n, m in linear_layers(module).items() if can_quantize(m, method)}


@torch.no_grad()
def quantize_component(component: str, module: torch.nn.Module, method: str, kept: Iterable[str] = (),
                       patterns: Iterable[str] = (), dtype: torch.dtype | None = None) -> ComponentReport:
    """Quantize every linear layer of `module` with `method` (torchao ``quantize_``), except
    the layers in `kept` (names relative to `module`), those matching `patterns` (see
    `matches`) and those the method cannot take (see `methods.can_quantize`). The int8 methods
    (`methods.EMBEDDING_METHODS`) also make its token-embedding tables int8
    (`embedding.quantize_embeddings`), except those matching `patterns`.

    Quantization happens where the weights are (on a GPU engine without offload: on the GPU,
    after the unquantized weights were loaded there).

    Args:
        component: the component's name in the folder (``transformer``, ``text_encoder``, ...).
        dtype: the model dtype, for the report's full-precision bytes (default: the first
            floating-point weight's).

    Returns:
        The component's report (``kept_layers`` qualified as ``component.layer``).
    """
    from torchao.quantization import quantize_

    kept, patterns = set(kept), tuple(patterns)
    layers = linear_layers(module)
    targets = {n for n, m in layers.items()
               if n not in kept and not matches(component, n, patterns) and can_quantize(m, method)}
    if dtype is None:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    full = full_precision_bytes(module, dtype)
    if targets:
        quantize_(module, torchao_config(method), filter_fn=lambda m, fqn: fqn in targets)
    tables: list[str] = []
    if method in EMBEDDING_METHODS:
        skip = {name for name, m in module.named_modules(remove_duplicate=False)
                if isinstance(m, torch.nn.Embedding) and (name in kept or matches(component, name, patterns))}
        tables = quantize_embeddings(module, skip)
    report = ComponentReport(method=method, source="quantized at load", quantized_layers=len(targets) + len(tables),
                             kept_layers=[f"{component}.{n}" for n in layers if n not in targets],
                             bytes=weight_bytes(module), full_precision_bytes=full)
    logger.info("quantized %s with %s: %d linear layers, %d embedding tables, %d kept in full precision, "
                "%.1f -> %.1f MiB", component, method, len(targets), len(tables), len(report.kept_layers),
                full / 2**20, report.bytes / 2**20)
    return report


def describe_loaded(component: str, module: torch.nn.Module, dtype: torch.dtype) -> ComponentReport | None:
    """The report of a component that arrived quantized (a pre-quantized diffusers /
    transformers folder with a torchao ``quantization_config``, or a GGUF file); None when it
    holds no quantized weight."""
    kinds: Counter[str] = Counter()
    quantized = 0
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor) and is_quantized_tensor(weight):
            quantized += 1
            quant_type = getattr(weight, "quant_type", None)
            kinds[getattr(quant_type, "name", None) or type(weight).__name__] += 1
    if not quantized:
        return None
    gguf = any(type(getattr(m, "weight", None)).__name__ == "GGUFParameter" for m in module.modules())
    config = getattr(getattr(module, "config", None), "quantization_config", None)
    if gguf:
        method, source = "gguf:" + "+".join(sorted(kinds)), "gguf file"
    else:
        method, source = "torchao:" + _torchao_config_name(config, kinds), "pre-quantized folder"
    layers = linear_layers(module)
    return ComponentReport(method=method, source=source, quantized_layers=quantized,
                           kept_layers=[f"{component}.{n}" for n in layers],
                           bytes=weight_bytes(module), full_precision_bytes=full_precision_bytes(module, dtype))


def _torchao_config_name(config: object, kinds: Counter[str]) -> str:
    """The torchao config class a pre-quantized folder names (diffusers keeps it as a dict,
    transformers as an object), else the tensor subclass names."""
    quant_type = config.get("quant_type") if isinstance(config, dict) else getattr(config, "quant_type", None)
    if isinstance(quant_type, dict):
        inner = quant_type.get("default", quant_type)
        if isinstance(inner, dict) and isinstance(inner.get("_type"), str):
            return inner["_type"]
    if quant_type is not None and not isinstance(quant_type, (dict, str)):
        return type(quant_type).__name__
    return "+".join(sorted(kinds))

