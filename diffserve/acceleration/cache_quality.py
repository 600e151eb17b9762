"""Quality levels of step caching (`SamplingParams.cache_quality`): what each named level
does, as a `CacheLevel`.

A level fixes how a request's steps are cached: the forecast's order
(`diffserve.acceleration.forecast`), how often a step is computed (``interval``: the check
steps), the TeaCache trip-wire on the modulated input's change, and the error budget the
run-time guard holds the request to (`diffserve.acceleration.cache_guard`). ``max`` never
skips. The budgets are measured error budgets: the PSNR they give vs the uncached image on the
built-in model (mean and worst image) is in the README's acceleration section
(``benchmarks/acceleration.py``). The defaults (order-1 forecasts of the denoiser output, a
check every 2, 3 or 4 steps at 20 steps) were picked there: order 2 and longer windows lost
more PSNR than they saved time. ``high`` warms up for 5 steps (at 20 steps; 12 at 50), the
others for 3: on that model the images that break are the ones whose trajectory amplifies a
deviation picked up in the first skipped windows, and no signal the guard sees singles them
out, so only computing the early steps protects them (worst image of 200 at 20 steps: 33.1 dB
with a 5-step warm-up, 23.6 dB with 3).

A model folder overrides any level's fields in its calibration (``diffserve_cache.json``:
``diffserve calibrate-cache`` fits each level's budget to a PSNR target on the model's own
trajectories) or its ``generation_config.json`` (``teacache.cache_quality``: ``{"fast":
{"budget": 0.02}}``; `levels_with`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import CACHE_QUALITY_LEVELS


#: The schedule length `CacheLevel.interval` is stated for.
REFERENCE_STEPS = 20


@dataclass(frozen=True)
class CacheLevel:
    """How one quality level caches a request's steps.

    Attributes:
        name: the level's name (``"custom"`` for plain TeaCache from ``rel_l1_thresh``).
        order: forecast order: 0 reuses the last computed residual (TeaCache), 1-2 forecast it
            with a Taylor expansion in the timestep (TaylorSeer).
        interval: a step is computed at least every `interval` steps of a 20-step schedule
            (the guard's check steps; scaled with the request's steps, `interval_for`, so a
            forecast spans the same share of the trajectory); 0 = only when TeaCache's
            accumulated change reaches `rel_l1_thresh`; 1 = never skip. It may be fractional
            (0 or >= 1): 2.8 computes every 7th step at 50 steps (and every 3rd at 20).
        rel_l1_thresh: TeaCache's threshold on the accumulated rescaled change of the
            modulated input since the last computed step (inf: not used).
        budget: the guard's bound on the request's estimated accumulated relative error
            (0: never skip; inf: no guard).
        warmup_steps: leading steps that always compute (>= 1), stated for a 20-step schedule
            and scaled like `interval` (`warmup_for`): the early steps are where skipping
            costs the most.
        target: what a skipped step forecasts: ``"residual"`` (the blocks' residual, added to
            the step's own embedded input; TeaCache) or ``"output"`` (the denoiser's output).
        forecast: how: ``"taylor"`` (the Newton/Taylor expansion of `order`, TaylorSeer) or
            ``"magnitude"`` (MagCache, arXiv:2506.09045: the last computed residual scaled by
            the model's calibrated magnitude ratio between the two steps; its a-priori error
            ``|1 - ratio|`` feeds the guard; needs ``target="residual"`` and a calibrated
            folder).
    """

    name: str
    order: int
    interval: float
    rel_l1_thresh: float
    budget: float
    warmup_steps: int
    target: str = "residual"
    forecast: str = "taylor"

    @property
    def skips(self) -> bool:
        """Whether the level can skip any step."""
        return self.budget > 0 and self.interval != 1

    def interval_for(self, num_steps: int) -> int:
        """`interval` for a schedule of `num_steps` steps: ``round(interval * num_steps / 20)``,
        at least 2 (0 and 1 stay as they are)."""
        if self.interval <= 1:
            return int(self.interval)
        return max(2, round(self.interval * num_steps / REFERENCE_STEPS))

    def warmup_for(self, num_steps: int) -> int:
        """`warmup_steps` for a schedule of `num_steps` steps: ``round(warmup_steps *
        num_steps / 20)``, at least `warmup_steps` (``custom`` keeps its own count)."""
        if self.name == "custom":
            return self.warmup_steps
        return max(self.warmup_steps, round(self.warmup_steps * num_steps / REFERENCE_STEPS))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The levels of any model whose folder declares none. The budgets were measured on the
#: built-in digits model (README: acceleration); other models are guarded by the same budget.
DEFAULT_LEVELS: dict[str, CacheLevel] = {
    "max": CacheLevel("max", order=0, interval=1, rel_l1_thresh=math.inf, budget=0.0, warmup_steps=1),
    "high": CacheLevel("high", order=1, interval=2, rel_l1_thresh=math.inf, budget=0.05, warmup_steps=5,
                       target="output"),
    "balanced": CacheLevel("balanced", order=1, interval=3, rel_l1_thresh=math.inf, budget=0.1, warmup_steps=3,
                           target="output"),
    "fast": CacheLevel("fast", order=1, interval=4, rel_l1_thresh=math.inf, budget=0.15, warmup_steps=3,
                       target="output"),
}

_CHOICES = {"target": ("residual", "output"), "forecast": ("taylor", "magnitude")}
#: Each numeric field: its type, lowest value, highest value, whether inf is allowed (what inf means).
_FIELDS = {"order": (int, 0, 2, False), "interval": (float, 0, None, False),
           "rel_l1_thresh": (float, 0, None, True), "budget": (float, 0, None, True),
           "warmup_steps": (int, 1, None, False)}
_ALLOWED_FIELDS = sorted([*_FIELDS, *_CHOICES])


def _number(field: str, value: Any, kind: type, low: float, high: float | None, infinite: bool) -> int | float:
    """`value` as `kind` if it is a number in ``[low, high]`` (NaN never; inf only where
    `infinite`; an integer for ``int``), else `InvalidRequestError` naming `field`."""
    noun = "an integer" if kind is int else "a number"
    allowed = f"{noun} in [{low}, {high}]" if high is not None else f"{noun} >= {low}"
    if kind is float:
        allowed += " (inf allowed)" if infinite else ", finite"
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
            or value < low or (high is not None and value > high)
            or (math.isinf(value) and not infinite)
            or (kind is int and (math.isinf(value) or value != int(value)))):
        raise InvalidRequestError(field, value, allowed)
    return kind(value)


def levels_with(*overrides: Mapping[str, Mapping[str, Any]] | None,
                fields: tuple[str, ...] = ()) -> dict[str, CacheLevel]:
    """`DEFAULT_LEVELS` with overrides applied in order (a model folder's, then the engine's
    ``cache_config.levels``), each ``{level: {field: value}}``; ``"budget": None`` = no guard.

    Args:
        overrides: ``{level: {field: value}}`` mappings (None: none), applied in order.
        fields: the name each override is known by, for errors (``"cache_config.levels"``);
            those past its end are ``"teacache.cache_quality"`` (a folder's
            ``generation_config.json``).

    Raises:
        InvalidRequestError: an unknown level or field, or a value out of range, naming
            ``FIELD.LEVEL.KEY`` and the allowed values.
    """
    levels = dict(DEFAULT_LEVELS)
    for index, override in enumerate(overrides):
        source = fields[index] if index < len(fields) else "teacache.cache_quality"
        if override is not None and not isinstance(override, Mapping):
            raise InvalidRequestError(source, override, "an object {level: {field: value}}")
        for name, level_fields in (override or {}).items():
            if name not in CACHE_QUALITY_LEVELS or name == "max":
                raise InvalidRequestError(f"{source}.{name}", name, "a level among high, balanced, fast")
            if not isinstance(level_fields, Mapping):
                raise InvalidRequestError(f"{source}.{name}", level_fields, f"an object of fields among {_ALLOWED_FIELDS}")
            levels[name] = _level_with(levels[name], level_fields, f"{source}.{name}")
    return levels


def _level_with(level: CacheLevel, fields: Mapping[str, Any], field: str) -> CacheLevel:
    """`level` with `fields` set (validated; errors name ``field.KEY``)."""
    values = {}
    for key, value in fields.items():
        if key in _CHOICES:
            if value not in _CHOICES[key]:
                raise InvalidRequestError(f"{field}.{key}", value, " or ".join(_CHOICES[key]))
            values[key] = value
        elif key == "budget" and value is None:
            values[key] = math.inf
        elif key in _FIELDS:
            values[key] = _number(f"{field}.{key}", value, *_FIELDS[key])
        else:
            raise InvalidRequestError(field, key, f"a field among {_ALLOWED_FIELDS}")
    if 0 < values.get("interval", 0) < 1:
        raise InvalidRequestError(f"{field}.interval", values["interval"], "0 or a number >= 1, finite")
    level = dataclasses.replace(level, **values)
    if level.forecast == "magnitude" and level.target != "residual":
        raise InvalidRequestError(f"{field}.forecast", "magnitude",
                                  "taylor, or magnitude with target residual (it scales the blocks' residual)")
    return level
