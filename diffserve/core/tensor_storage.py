"""Bytes a tensor really holds, tensor subclasses included (used by the memory accounting and
by quantization's reports; imports no torch).

A torchao quantized weight (``Int8Tensor``, ``Float8Tensor``, ...) is a traceable wrapper
subclass: its ``shape`` and ``dtype`` are the float weight's, so ``numel() * element_size()``
(and even its ``untyped_storage().nbytes()``) report the full-precision size. Its real memory
is that of the plain tensors it flattens into (``__tensor_flatten__``: int8 data, scales, zero
points). GGUF parameters (diffusers' ``GGUFParameter``) are plain uint8 tensors of the packed
blocks, so the ordinary count is right for them.
"""

from __future__ import annotations

from typing import Any


def inner_tensors(t: Any) -> list[tuple[str, Any]]:
    """The plain tensors holding `t`'s data: ``[("", t)]`` for a plain tensor; for a
    traceable wrapper subclass, its flattened inner tensors (recursively), named by their
    attribute path (``"qdata"``, ``"scale"``, ``"a.b"``)."""
    if getattr(type(t), "__tensor_flatten__", None) is None:
        return [("", t)]
    names, _ = t.__tensor_flatten__()
    out = []
    for name in names:
        inner = getattr(t, name)
        if inner is None:
            continue
        out.extend((f"{name}.{sub}" if sub else name, x) for sub, x in inner_tensors(inner))
    return out


def is_wrapper(t: Any) -> bool:
    """Whether `t` is a wrapper subclass whose data lives in inner tensors."""
    return getattr(type(t), "__tensor_flatten__", None) is not None


def tensor_bytes(t: Any) -> int:
    """Bytes of the data `t` holds (see the module docstring); a plain tensor's
    ``numel() * element_size()``."""
    return sum(x.numel() * x.element_size() for _, x in inner_tensors(t))


def set_inner(t: Any, path: str, value: Any) -> None:
    """Replace the inner tensor at attribute `path` (as `inner_tensors` names it) of the
    wrapper `t` by `value`."""
    *parents, last = path.split(".")
    for name in parents:
        t = getattr(t, name)
    setattr(t, last, value)
