"""Torch-free parts of the connector: payload handles, the wire header, accounting and errors.

A `PayloadHandle` is what travels between stages (through the engine, in plain picklable
messages) in place of the tensors: which request, which connector, and for each guidance
branch of the request (``"cond"``, ``"negative"``, ...) a `PartRef` naming its stored content by
hash (and, for shared memory, the segment holding it). The tensors stay in the connector until
the consuming stage calls ``get``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

#: Magic and version of the packed payload layout (`pack_header` / `unpack_header`).
MAGIC = b"DSPL"
VERSION = 1
#: Byte alignment of every tensor's data in a packed payload.
ALIGN = 64
#: Payload kinds: per-layer K/V, hidden states, token ids.
KINDS = ("kv", "hidden_states", "token_ids")


class PayloadMissingError(RuntimeError):
    """A request's payload (or one of its guidance branches) is not in the connector: never
    put, already freed, or the producing stage failed. The request fails with this error
    (a missing guidance branch never silently drops classifier-free guidance)."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of a packed payload lies.

    Attributes:
        name: its key in `Payload.tensors`.
        dtype: torch dtype name without the ``torch.`` prefix (``"float32"``, ``"bfloat16"``, ``"int64"``).
        shape: its shape.
        offset: byte offset of its data from the start of the data section (a multiple of `ALIGN`).
        nbytes: its size in bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PayloadHeader:
    """The self-describing header of a packed payload (JSON after the magic, version and length).

    Attributes:
        kind: one of `KINDS`.
        meta: JSON-able metadata (e.g. ``{"positions": [0, L), "num_layers": 4, "text": "seven"}``).
        tensors: the tensors' `TensorSpec` s, data in this order.
        digest: the content hash (hex) of kind, meta, tensor specs and bytes.
    """

    kind: str
    meta: dict[str, Any]
    tensors: tuple[TensorSpec, ...]
    digest: str

    @property
    def data_bytes(self) -> int:
        """Bytes of the data section (up to the end of the last tensor)."""
        return max((t.offset + t.nbytes for t in self.tensors), default=0)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_header(header: PayloadHeader) -> bytes:
    """The header bytes: ``MAGIC``, u16 version, u32 JSON length, JSON, zero padding to `ALIGN`
    (so the data section that follows starts aligned)."""
    body = json.dumps({"kind": header.kind, "meta": header.meta, "digest": header.digest,
                       "tensors": [asdict(t) for t in header.tensors]}, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<HI", VERSION, len(body)) + body
    return prefix + b"\0" * (_aligned(len(prefix)) - len(prefix))


def unpack_header(buffer: memoryview | bytes) -> tuple[PayloadHeader, int]:
    """Parse the header at the start of a packed payload.

    Returns:
        ``(header, data_start)``: the header and the byte offset of the data section.

    Raises:
        ValueError: not a packed payload, another layout version, or a corrupt header (a
            tensor span outside the buffer).
    """
    view = memoryview(buffer)
    if bytes(view[:4]) != MAGIC:
        raise ValueError("not a diffserve payload (bad magic)")
    version, length = struct.unpack("<HI", view[4:10])
    if version != VERSION:
        raise ValueError(f"payload layout version {version}, expected {VERSION}")
    body = json.loads(bytes(view[10:10 + length]))
    tensors = tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
                    for t in body["tensors"])
    header = PayloadHeader(body["kind"], body["meta"], tensors, body["digest"])
    start = _aligned(10 + length)
    if start + header.data_bytes > len(view):
        raise ValueError(f"corrupt payload: {header.data_bytes} data bytes past a {len(view)}-byte buffer")
    return header, start


def layout(specs: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[TensorSpec, ...]:
    """Aligned `TensorSpec` s for ``(name, dtype, shape, nbytes)`` entries, data in order."""
    out, at = [], 0
    for name, dtype, shape, nbytes in specs:
        out.append(TensorSpec(name, dtype, tuple(int(s) for s in shape), at, int(nbytes)))
        at = _aligned(at + nbytes)
    return tuple(out)


@dataclass(frozen=True)
class PartRef:
    """One guidance branch's payload inside a handle.

    Attributes:
        branch: the branch name (``"cond"``, ``"negative"``; a family's own names).
        digest: content hash of the payload (equal payloads share one stored copy).
        nbytes: its tensors' bytes.
        location: where a consumer in another process finds it (shared memory: the segment
            name); None in process.
    """

    branch: str
    digest: str
    nbytes: int
    location: str | None = None


@dataclass(frozen=True)
class PayloadHandle:
    """A request's payloads (one per guidance branch) in a connector: plain, picklable data.

    Attributes:
        request_id: the request.
        connector: the kind of connector that holds them (``"inprocess"``, ``"shared_memory"``).
        parts: one `PartRef` per branch, in put order.
    """

    request_id: str
    connector: str
    parts: tuple[PartRef, ...]

    @property
    def branches(self) -> tuple[str, ...]:
        return tuple(p.branch for p in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of all branches (a shared copy counts once per branch that uses it)."""
        return sum(p.nbytes for p in self.parts)

    def require(self, branches: tuple[str, ...] | list[str]) -> None:
        """Check that every branch a consumer needs travels with the request.

        Raises:
            PayloadMissingError: naming the missing branch(es) and the ones present.
        """
        missing = [b for b in branches if b not in self.branches]
        if missing:
            raise PayloadMissingError(
                f"request {self.request_id!r}: the {', '.join(repr(b) for b in missing)} branch payload is missing "
                f"(present: {', '.join(repr(b) for b in self.branches) or 'none'}); guidance needs every branch's "
                "context, so the request fails instead of running without it")


@dataclass
class ConnectorStats:
    """Accounting of one connector side (all counters since creation; bytes are tensor bytes).

    Attributes:
        puts / gets / frees: requests put, fetched and freed.
        parts_put: branch payloads put.
        bytes_put: bytes of all parts put (before deduplication).
        bytes_copied: bytes copied on put or get (0 in process: nothing is copied).
        dedup_hits: parts whose content was already stored (stored once, counted here).
        dedup_bytes: bytes those hits did not store again.
        resident_requests: requests whose payloads are held (put and not freed).
        resident_payloads: distinct payloads held (after deduplication).
        resident_bytes: bytes of the distinct payloads held.
        peak_resident_bytes: the highest `resident_bytes` seen.
        missing: gets that failed because a payload or a branch was missing.
    """

    puts: int = 0
    gets: int = 0
    frees: int = 0
    parts_put: int = 0
    bytes_put: int = 0
    bytes_copied: int = 0
    dedup_hits: int = 0
    dedup_bytes: int = 0
    resident_requests: int = 0
    resident_payloads: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    missing: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


__all__ = ["ALIGN", "ConnectorStats", "KINDS", "PartRef", "PayloadHandle", "PayloadHeader", "PayloadMissingError",
           "TensorSpec", "layout", "pack_header", "unpack_header"]
