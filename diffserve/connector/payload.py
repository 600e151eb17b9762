"""`Payload`: what one stage hands the next for one guidance branch of a request, and its
packed form.

A payload is a kind (``"kv"``: per-layer keys and values; ``"hidden_states"``; ``"token_ids"``),
named tensors and JSON-able metadata. The AR stage of `digits-reasoning` puts one ``"kv"``
payload per branch: ``tensors["kv"]`` (L, num_layers, 2, H_kv, D) in the LM's dtype (token
position first; keys carry their rotary position embedding) and ``meta`` = ``{"positions": [0,
L], "num_layers", "num_kv_heads", "head_dim", "token_ids": [...]}``; GLM-Image's AR stage puts
one ``"token_ids"`` payload (the prior image tokens, int64 (N,)).

Packed form (shared memory): the `handles.pack_header` header (magic, version, JSON with the
kind, meta, each tensor's dtype / shape / offset / size, and the content hash), then each
tensor's bytes at a 64-byte-aligned offset. `unpack` returns tensors that VIEW the buffer (no
copy).

Content hash (`digest`): BLAKE2b-128 over the kind, the canonical JSON of meta and of the
tensor specs, and every tensor's bytes. Equal payloads (the empty negative prompt's K/V of
every request) have equal digests; connectors store them once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from diffserve.connector.handles import KINDS, PayloadHeader, layout, pack_header, unpack_header


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a payload")
    return dtype


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a memoryview (CPU, contiguous; copies only when it is not)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


@dataclass
class Payload:
    """One branch's product of a stage (see the module docstring).

    Attributes:
        kind: one of ``"kv"``, ``"hidden_states"``, ``"token_ids"``.
        tensors: named tensors (any device; packed from host memory).
        meta: JSON-able metadata.

    Raises:
        ValueError: an unknown kind, or meta that is not JSON-able.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    _digest: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"payload kind must be one of {KINDS}, got {self.kind!r}")
        json.dumps(self.meta)  # raises TypeError for non-JSON-able meta

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def header(self) -> PayloadHeader:
        """The packed layout of this payload (computes the digest once)."""
        specs = layout([(name, _dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
                        for name, t in self.tensors.items()])
        return PayloadHeader(self.kind, self.meta, specs, self.digest)

    @property
    def digest(self) -> str:
        """Content hash (hex, see the module docstring); computed on first use."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(self.kind.encode())
            h.update(json.dumps(self.meta, sort_keys=True, separators=(",", ":")).encode())
            for name, t in self.tensors.items():
                h.update(json.dumps([name, _dtype_name(t.dtype), list(t.shape)]).encode())
                h.update(_host_bytes(t))
            self._digest = h.hexdigest()
        return self._digest

    def packed_size(self) -> int:
        """Bytes of the packed form (header + aligned data)."""
        header = self.header()
        return len(pack_header(header)) + header.data_bytes

    def pack_into(self, buffer: memoryview) -> int:
        """Write the packed form into `buffer` (at least `packed_size` bytes).

        Returns:
            The bytes of tensor data copied.
        """
        header = self.header()
        head = pack_header(header)
        buffer[: len(head)] = head
        copied = 0
        for spec in header.tensors:
            data = _host_bytes(self.tensors[spec.name])
            start = len(head) + spec.offset
            buffer[start:start + spec.nbytes] = data
            copied += spec.nbytes
        return copied

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Payload":
        """This payload with its tensors on `device` (itself when they already are)."""
        device = torch.device(device)
        if all(t.device == device for t in self.tensors.values()):
            return self
        return Payload(self.kind, {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()},
                       self.meta, self._digest)


def unpack(buffer: Any) -> Payload:
    """The payload packed in `buffer` (bytes-like, e.g. a shared-memory mapping), its tensors
    viewing the buffer (no copy: they keep it alive, and it must not change while they live).

    Raises:
        ValueError: not a packed payload, or a corrupt one (`handles.unpack_header`).
    """
    header, start = unpack_header(buffer)
    tensors = {}
    for spec in header.tensors:
        dtype = _torch_dtype(spec.dtype)
        if spec.nbytes == 0:
            tensors[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=spec.nbytes, offset=start + spec.offset)
        tensors[spec.name] = raw.view(dtype).reshape(spec.shape)
    return Payload(header.kind, tensors, header.meta, header.digest)


__all__ = ["Payload", "unpack"]
