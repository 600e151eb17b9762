"""The ``cache_dit`` backend: cache-dit's DBCache (optionally with TaylorSeer) on our transformer.

cache-dit (github.com/vipshop/cache-dit, pip ``cache-dit``) wraps the transformer's block list:
the first ``Fn_compute_blocks`` blocks always run; when the relative L1 change of their
residual since the request's previous step is below ``residual_diff_threshold`` the middle
blocks are skipped and their cached residual reused (optionally extrapolated by TaylorSeer,
Liu et al. 2025, arXiv:2503.06923); the last ``Bn_compute_blocks`` blocks always run.

Where cache-dit keeps its state, and how we make it per request: cache-dit stores every
mutable thing (step counters, cached residual buffers, residual diffs, calibrators) in a
``CachedContext`` object; the patched blocks look their context up by name in the
transformer's ``CachedContextManager`` at every forward. We create one ``CachedContext`` per
request at its start (``num_inference_steps`` = that request's step count), keep it in the
request's ``RequestState.extra``, and put it under that name just for the request's own
forwards. So no state leaks between requests, and step counts and resolutions may change
between requests.

Limitation: cache-dit takes ONE caching decision per forward, from a diff over the whole batch
tensor, and keeps one residual buffer for the whole batch. Two requests sharing a forward
would share the decision and overwrite each other's buffers, so their outputs would depend on
each other. This backend therefore declares ``shares_forward = False``: the runner runs each
request of a step batch in its own transformer forward (with its own context). Requests still
interleave step by step, but cache_dit requests do not batch together; use ``teacache`` to
combine caching with batched forwards. Measured on the built-in digits model (CPU, 1 thread,
``benchmarks/acceleration.py``): batching 8 requests per forward is worth ~2.3x there, so with
16-row batches cache_dit (F1B0, threshold 0.25, 63 % of steps cached) ran at 0.67x the
uncached batched engine, while one request at a time it gave 1.49x.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch

from diffserve.acceleration.backend import CacheBackend
from diffserve.config import CacheDiTConfig
from diffserve.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from diffserve.pipelines.base import PipelineAdapter, RequestState
    from diffserve.pipelines.step_batch import StepBatch

STATE_KEY = "cache_dit"

#: cache-dit 1.5.3's DBCacheConfig defaults (Fn_compute_blocks is clamped to the model).
DEFAULT_FN_COMPUTE_BLOCKS = 8


def _import_cache_dit():
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
    try:
        import cache_dit
    except ImportError as exc:  # optional dependency
        raise InvalidRequestError("cache_backend", "cache_dit", "installed with pip install cache-dit",
                                  detail=str(exc)) from exc
    return cache_dit


class CacheDiTBackend(CacheBackend):
    """The ``cache_dit`` backend (see the module docstring).

    Installs cache-dit's hooks on the adapter's denoiser once (``cache_dit.enable_cache`` with
    a transformer-only ``BlockAdapter``).

    Raises:
        InvalidRequestError: cache-dit is not installed, the model family declares no
            cache-dit block pattern, or Fn + Bn >= the number of blocks.
    """

    name = "cache_dit"
    shares_forward = False

    def __init__(self, adapter: "PipelineAdapter", config: CacheDiTConfig):
        super().__init__()
        cache_dit = _import_cache_dit()
        from cache_dit.caching.block_adapters import FakeDiffusionPipeline
        from cache_dit.caching.cache_contexts.cache_context import CachedContext

        model = adapter.denoiser
        support = adapter.capabilities.cache_dit
        if support is None:
            raise InvalidRequestError(
                "cache_backend", "cache_dit",
                f"a backend {adapter.pipeline_class_name} supports (cache_dit has no block pattern for it)")
        block_lists = [getattr(model, name) for name in support.blocks]
        # cache-dit applies Fn / Bn to each block list (one context each): every list needs
        # blocks left to cache
        num_blocks = min(len(blocks) for blocks in block_lists)
        fn = config.Fn_compute_blocks
        if fn is None:
            fn = max(1, min(DEFAULT_FN_COMPUTE_BLOCKS, num_blocks - 1 - config.Bn_compute_blocks))
        if fn + config.Bn_compute_blocks >= num_blocks:
            raise InvalidRequestError(
                "cache_config.Fn_compute_blocks", fn,
                f"such that Fn + Bn_compute_blocks ({config.Bn_compute_blocks}) < {num_blocks} "
                "(the model's transformer blocks per cached block list), so some blocks can be cached")
        self.config = config
        self.Fn_compute_blocks = fn
        cache_config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=fn,
            Bn_compute_blocks=config.Bn_compute_blocks,
            residual_diff_threshold=config.residual_diff_threshold,
            max_warmup_steps=config.max_warmup_steps,
            warmup_interval=config.warmup_interval,
            max_cached_steps=config.max_cached_steps,
            max_continuous_cached_steps=config.max_continuous_cached_steps,
            enable_separate_cfg=False,  # our CFG rows share one forward
        )
        calibrator = None
        if config.taylorseer:
            # A family whose last block returns no encoder stream (SD3: context_pre_only) has no
            # encoder residual to extrapolate: cache-dit's encoder calibrator would fail with
            # "State 'transformer_blocks_Bn_residual' not found"; only the image stream is used.
            calibrator = cache_dit.TaylorSeerCalibratorConfig(
                taylorseer_order=config.taylorseer_order,
                enable_encoder_calibrator=support.has_encoder_residual)
        patterns = [getattr(cache_dit.ForwardPattern, p) for p in support.patterns]
        block_adapter = cache_dit.BlockAdapter(
            pipe=FakeDiffusionPipeline(model), transformer=model,
            blocks=block_lists[0] if len(block_lists) == 1 else block_lists,
            forward_pattern=patterns[0] if len(patterns) == 1 else patterns,
        )
        cache_dit.enable_cache(block_adapter, cache_config=cache_config, calibrator_config=calibrator)
        self._manager = model._context_manager
        self._context_names = list(model._context_names)  # one context per block list
        self._templates = {name: self._manager.get_context(name)._init_kwargs for name in self._context_names}
        self._context_cls = CachedContext

    def new_contexts(self, num_steps: int | None) -> dict[str, Any]:
        """Fresh cache-dit ``CachedContext`` s (one per block list) for a request of
        `num_steps` steps."""
        contexts = {}
        for name, template in self._templates.items():
            kwargs = copy.deepcopy(template)
            kwargs["cache_config"].num_inference_steps = num_steps
            contexts[name] = self._context_cls(**kwargs)
        return contexts

    def check_params(self, params) -> None:
        """cache-dit has one threshold per engine: a request's ``cache_quality`` is refused.

        Raises:
            InvalidRequestError: (field ``cache_quality``) set.
        """
        if params.cache_quality is not None:
            raise InvalidRequestError("cache_quality", params.cache_quality,
                                      "unset: the cache_dit backend has no per-request quality levels "
                                      "(--cache-backend teacache has them)")

    def reset(self, state: "RequestState") -> None:
        """Give the request its own fresh cache-dit contexts (sized to its step count)."""
        state.extra[STATE_KEY] = self.new_contexts(state.num_steps)

    def denoise(self, adapter: "PipelineAdapter", batch: "StepBatch") -> torch.Tensor:
        """One request's forward with its own context swapped into the transformer.

        Raises:
            ValueError: the batch holds more than one request.
        """
        if len(batch.states) != 1:
            raise ValueError("the cache_dit backend runs one request per forward")
        mine = batch.states[0].extra[STATE_KEY]
        first = mine[self._context_names[0]]
        cached_before = first.accumulated_cached_steps
        contexts = self._manager._cached_context_manager
        contexts.update(mine)
        try:
            out = adapter.denoise(batch)
        finally:
            # Fresh idle contexts: forwards outside a request never touch a request's state.
            contexts.update(self.new_contexts(None))
            self._manager._current_context = None
        self.transformer_calls += 1
        self.skipped += first.accumulated_cached_steps - cached_before
        return out

    def stats(self) -> dict[str, Any]:
        """`CacheBackend.stats` plus the DBCache settings in use."""
        return {**super().stats(), "Fn_compute_blocks": self.Fn_compute_blocks,
                "Bn_compute_blocks": self.config.Bn_compute_blocks,
                "residual_diff_threshold": self.config.residual_diff_threshold,
                "taylorseer": self.config.taylorseer}
