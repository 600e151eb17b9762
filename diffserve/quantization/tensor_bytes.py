"""Bytes a tensor really holds, tensor subclasses included.

A torchao quantized weight (``Int8Tensor``, ``Float8Tensor``, ...) is a wrapper subclass: its
``shape`` and ``dtype`` are the float weight's, so ``numel() * element_size()`` (and even its
``untyped_storage().nbytes()``) report the full-precision size. Its real memory is that of the
plain tensors it flattens into (``__tensor_flatten__``: int8 data, scales, zero points).
GGUF parameters (diffusers' ``GGUFParameter``) are plain uint8 tensors of the packed blocks, so
the ordinary count is right for them.
"""

from __future__ import annotations

import torch


def inner_tensors(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The plain tensors holding `t`'s data: ``[("", t)]`` for a plain tensor; for a
    traceable wrapper subclass, its flattened inner tensors (recursively), named by their
    attribute path (``"qdata"``, ``"scale"``, ...)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return [("", t)]
    names, _ = t.__tensor_flatten__()
    out = []
    for name in names:
        inner = getattr(t, name)
        if inner is None:
            continue
        out.extend((f"{name}.{sub}" if sub else name, x) for sub, x in inner_tensors(inner))
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the data `t` holds (see the module docstring); a plain tensor's
    ``numel() * element_size()``."""
    return sum(x.numel() * x.element_size() for _, x in inner_tensors(t))


def is_quantized_tensor(t: torch.Tensor) -> bool:
    """Whether `t` is a quantized weight: a torchao tensor subclass or a GGUF parameter."""
    name = type(t).__name__
    return len(inner_tensors(t)) > 1 or name == "GGUFParameter" or type(t).__module__.startswith("torchao")
