"""`Connector`: how one stage hands a request's payloads to the next (the interface).

Lifetimes (every implementation):

- the producing stage calls `Connector.put` once per request with ALL its guidance branches
  (one unit: a request's branches are stored, fetched, accounted and freed together) and sends
  the returned `PayloadHandle` on (plain data);
- the consuming stage calls `Connector.get` with the handle and the branches it needs; a branch
  that did not travel raises `PayloadMissingError` (the request fails; it never runs with one
  branch dropped);
- EVERY stage that touched the request calls `Connector.free` with its id when the request
  finishes, fails or is aborted (idempotent: an unknown or already freed id is ignored), so
  nothing outlives its request whichever stage it ended in;
- equal payloads (same content hash) are stored once; each request holds a reference, and the
  stored copy goes when its last request is freed.

Implementations: `inprocess.InProcessConnector` (the stages share a process: the tensors are
passed by reference, nothing is copied) and `shared_memory.SharedMemoryConnector` (the stages
are processes: one POSIX shared-memory segment per distinct payload, written once by the
producer, mapped without a copy by the consumer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from diffserve.connector.handles import ConnectorStats, PayloadHandle
from diffserve.connector.payload import Payload


class Connector(ABC):
    """A request-payload channel between two stages (see the module docstring)."""

    #: `PayloadHandle.connector` of the handles this connector issues.
    name: str = ""

    @abstractmethod
    def put(self, request_id: str, parts: Mapping[str, Payload]) -> PayloadHandle:
        """Store a request's payloads, one per guidance branch, as one unit.

        Args:
            request_id: the request (not already put and not freed).
            parts: branch name -> payload (at least one).

        Returns:
            The handle to send to the consuming stage.

        Raises:
            ValueError: no parts, or the request already has payloads here.
        """

    @abstractmethod
    def get(self, handle: PayloadHandle, branches: Sequence[str] | None = None) -> dict[str, Payload]:
        """The request's payloads for `branches` (default: every branch of the handle).

        Tensors are shared with the connector (no copy): treat them as read-only.

        Raises:
            PayloadMissingError: a needed branch did not travel, or the payloads were freed
                (or never put).
        """

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Drop this side's hold on the request's payloads (finished, failed or aborted).
        Idempotent; an unknown id is ignored."""

    @abstractmethod
    def stats(self) -> ConnectorStats:
        """Accounting of this side (see `ConnectorStats`)."""

    def close(self) -> None:
        """Free every request still held (shutdown)."""


__all__ = ["Connector"]
