"""What a step adapter declares about its denoiser for the acceleration and parallel layers
(`Capabilities`: TeaCache forward split, cache-dit block pattern, regional-compile blocks, the
context-parallel plan), and the engine options it is built with (`AdapterOptions`).

A family's plug-ins that implement them sit in its folder (e.g. ``flux/teacache.py``,
``sd3/context_parallel.py``); a model folder's calibration (``diffserve_cache.json``, from
``diffserve calibrate-cache``) and ``generation_config.json`` ``teacache`` entry override the
declared coefficients (`TeaCacheSupport.with_preset`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class TeaCacheSupport:
    """How TeaCache (`diffserve.acceleration.teacache`) splits this family's denoiser forward.

    TeaCache needs the forward in three parts around the repeated blocks; `split` implements
    them for the family's denoiser class.

    Attributes:
        split: an object with ``embed(model, kwargs) -> (hidden, context, modulated)``,
            ``blocks(model, hidden, context) -> hidden`` and ``head(model, hidden, context) ->
            output`` (``context`` is whatever the blocks and the head need besides the image
            stream, sliced per row by TeaCache with `select_rows`), and
            ``select_rows(context, index) -> context``.
        coefficients: rescaling polynomial (``numpy.poly1d`` order) from the modulated-input
            relative L1 change to the output change.
        rel_l1_thresh: default threshold on the accumulated rescaled change.
        source: where the coefficients come from.
        levels: the model's own fields of the quality levels (``{level: {field: value}}``,
            `diffserve.acceleration.cache_quality.levels_with`), None = the defaults.
        residual_log_norms: the model's calibrated residual magnitude curve for magnitude
            forecasts (MagCache): ``log`` of the mean per-token L2 norm of the blocks' residual
            at each step of an uncached schedule (evenly spaced over its steps), None = not
            calibrated (``diffserve calibrate-cache`` writes it).
    """

    split: Any
    coefficients: tuple[float, ...]
    rel_l1_thresh: float
    source: str
    levels: Mapping[str, Any] | None = None
    residual_log_norms: tuple[float, ...] | None = None

    def with_preset(self, preset: Mapping[str, Any]) -> "TeaCacheSupport":
        """This support with a model folder's calibrated preset (the ``teacache`` entry of its
        ``generation_config.json`` overlaid by that of its ``diffserve_cache.json``:
        ``coefficients``, ``rel_l1_thresh``, ``source``, ``cache_quality`` (the levels' fields),
        ``residual_log_norms``, each optional) in place of the declared values."""
        norms = preset.get("residual_log_norms", self.residual_log_norms)
        return replace(self, coefficients=tuple(preset.get("coefficients", self.coefficients)),
                       rel_l1_thresh=float(preset.get("rel_l1_thresh", self.rel_l1_thresh)),
                       source=preset.get("source", self.source),
                       levels=preset.get("cache_quality", self.levels),
                       residual_log_norms=None if norms is None else tuple(float(v) for v in norms))


@dataclass(frozen=True)
class CacheDiTSupport:
    """How cache-dit's DBCache wraps this family's denoiser.

    Attributes:
        blocks: attribute names of the block lists on the denoiser, in forward order.
        patterns: cache-dit ``ForwardPattern`` names, one per block list.
        has_encoder_residual: whether the last block returns an encoder stream (TaylorSeer's
            encoder calibrator needs it).
    """

    blocks: tuple[str, ...]
    patterns: tuple[str, ...]
    has_encoder_residual: bool = True


@dataclass(frozen=True)
class Capabilities:
    """What acceleration an adapter supports and how.

    Attributes:
        teacache: TeaCache forward split and coefficients, or None (backend refused).
        cache_dit: cache-dit block description, or None (backend refused).
        repeated_blocks: class names of the denoiser's repeated blocks for regional compile
            (default: the diffusers class's ``_repeated_blocks``), empty = refused.
        context_parallel: ``prepare(denoiser) -> plan``: installs what Ulysses sequence
            parallelism needs on the denoiser and returns its diffusers context-parallel plan;
            None = the diffusers class's own ``_cp_plan`` (refused when it has none).
    """

    teacache: TeaCacheSupport | None = None
    cache_dit: CacheDiTSupport | None = None
    repeated_blocks: tuple[str, ...] = ()
    context_parallel: Callable[[torch.nn.Module], dict] | None = None


@dataclass
class AdapterOptions:
    """Engine options an adapter reads when it is built.

    Attributes:
        context_folding: allow exact sequence-shortening tricks of the family (SD3 without T5:
            the 256 zero T5 rows as one token; Wan: the zero padding rows of the prompt as one).
        model_dir: the model folder (for `generation_config.json`).
    """

    context_folding: bool = True
    model_dir: Path | None = None


__all__ = ["AdapterOptions", "CacheDiTSupport", "Capabilities", "TeaCacheSupport"]
