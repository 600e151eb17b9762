"""Connectors: how one stage of a multi-stage model (an AR stage) hands a request's payloads
(per-layer K/V, hidden states or token ids; one per guidance branch) to the next (the DiT
stage). See ``README.md`` in this folder for the interface, the payload format and the
lifetimes.

Layering: a technique package. It imports nothing of diffserve's runner, executor, engine or
entrypoints; `handles` is torch-free (what travels in messages), `payload` and the
implementations use torch.
"""

from __future__ import annotations

from diffserve.connector.handles import ConnectorStats, PartRef, PayloadHandle, PayloadMissingError

#: ``--connector`` names -> "module:Class".
CONNECTORS = {
    "inprocess": "diffserve.connector.inprocess:InProcessConnector",
    "shared_memory": "diffserve.connector.shared_memory:SharedMemoryConnector",
}


def make_connector(name: str):
    """A new connector by name (`CONNECTORS`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    import importlib

    target = CONNECTORS.get(name)
    if target is None:
        raise ValueError(f"unknown connector {name!r}; known: {', '.join(CONNECTORS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["CONNECTORS", "ConnectorStats", "PartRef", "PayloadHandle", "PayloadMissingError", "make_connector"]
