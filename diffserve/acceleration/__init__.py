"""Acceleration: prompt-embedding cache, step-caching backends (TeaCache, cache-dit) and
regional torch.compile, set up once per loaded model by `Accelerator`."""

from __future__ import annotations

from typing import Any

from diffserve.errors import InvalidRequestError

#: Values of ``EngineConfig.cache_backend``.
CACHE_BACKENDS = ("none", "teacache", "cache_dit")


def parse_cache_config(backend: str, options: Any):
    """Validate ``EngineConfig.cache_backend`` and ``cache_config``.

    Returns:
        None for ``none`` (which takes no options), else the backend's typed config
        (`TeaCacheConfig` or `CacheDiTConfig`).

    Raises:
        InvalidRequestError: unknown backend, options not a dict, unknown key, bad value.
    """
    if backend not in CACHE_BACKENDS:
        raise InvalidRequestError("cache_backend", backend, f"one of {', '.join(CACHE_BACKENDS)}")
    if not isinstance(options, dict):
        raise InvalidRequestError("cache_config", options, "a JSON object / dict of backend options")
    if backend == "teacache":
        from diffserve.acceleration.teacache import TeaCacheConfig

        return TeaCacheConfig.from_dict(options)
    if backend == "cache_dit":
        from diffserve.acceleration.cache_dit import CacheDiTConfig

        return CacheDiTConfig.from_dict(options)
    if options:
        raise InvalidRequestError("cache_config", options, "empty when cache_backend is none")
    return None
