"""TeaCache, with per-request caching decisions inside a mixed step batch, for any adapter that
declares a forward split (`diffserve.pipelines.base.TeaCacheSupport`).

TeaCache (Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache for Video Diffusion
Model", arXiv:2411.19108): the transformer's output changes between steps about as much as
its timestep-modulated input does. For each request and step:

1. compute the modulated input ``m_t`` = the first block's AdaLayerNormZero output
   (``transformer_blocks[0].norm1(pos_embed(x_t), temb)[0]``, cheap);
2. ``d_t = mean|m_t - m_{t-1}| / mean|m_{t-1}|`` over the request's rows (all CFG rows);
3. accumulate ``acc += max(0, poly(d_t))``, where ``poly`` is a per-model-family polynomial
   mapping the input change to the output change (the rescaling coefficients below);
4. if ``acc < rel_l1_thresh`` skip all transformer blocks and reuse the request's cached
   residual (``hidden after blocks - hidden before blocks`` from its last computed step);
   otherwise run the blocks, store the new residual and reset ``acc = 0``.

Beyond reuse, each request runs at its own quality level (`SamplingParams.cache_quality`,
`diffserve.acceleration.cache_quality`): a skipped step forecasts the residual from the last
computed ones (TaylorSeer, `diffserve.acceleration.forecast`; or MagCache's magnitude ratio,
`magnitude_ratio`, for a level with ``forecast="magnitude"``) instead of repeating the last
one, steps are computed at least every ``interval`` steps, and a run-time guard
(`diffserve.acceleration.cache_guard`) computes any step whose skipping would take the
request's estimated accumulated error past its level's budget. The level ``custom`` is plain
TeaCache as above (the engine's ``rel_l1_thresh``).

The first ``warmup_steps`` steps and the last step always compute. The adapter's split says
what runs outside the blocks (patch/time/text embeddings before, the output head after); those
always run. The backend wraps ``adapter.denoise`` (its ``call`` hook), so the adapter's own
input preparation and output post-processing stay in place.

In a step batch each request decides on its own rows (all guidance branches); the blocks run
only on the rows of the requests that compute, and the others add their own cached residual,
so a request's result equals running it alone with the same settings (within float tolerance
of batching).

Rescaling coefficients come from the adapter (``TeaCacheSupport.coefficients``, per family), or
from the model folder's calibration (``diffserve_cache.json``, written by ``diffserve
calibrate-cache --model DIR``, e.g. the built-in digits model's; `TeaCacheSupport.with_preset`).
With ``record_changes`` the backend records the points that calibration fits them on: per step of
a ``max``-level request, ``(relative_l1(m_t, m_t-1), relative_l1(out_t, out_t-1))``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from diffserve.acceleration.backend import CacheBackend
from diffserve.acceleration.cache_guard import GuardState
from diffserve.acceleration.cache_quality import CacheLevel, levels_with
from diffserve.acceleration.forecast import Forecaster
from diffserve.config import TeaCacheConfig
from diffserve.core.errors import InvalidRequestError
from diffserve.pipelines.row_data import narrowed_rows
from diffserve.pipelines.token_spans import LATENT_SIZE

if TYPE_CHECKING:
    from diffserve.pipelines.base import PipelineAdapter, RequestState
    from diffserve.pipelines.step_batch import StepBatch

STATE_KEY = "teacache"


@dataclass
class TeaCacheState:
    """One request's step-caching state (in ``RequestState.extra["teacache"]``). Tensors and
    the forecaster / guard are replaced, never changed in place, so a shallow copy saves it.

    Attributes:
        num_steps: the request's denoising steps (the last one always computes).
        level: its quality level.
        timesteps: its timestep at each step (floats), the forecast's variable.
        step: steps taken so far.
        accumulated: TeaCache's accumulated rescaled change since the last computed step.
        since_compute: steps skipped since the last computed step.
        skipped: steps skipped so far.
        previous_modulated: (rows, N_img, D) modulated input of the previous step.
        history: (timestep, residual (rows, N_img, D)) of the last computed steps, oldest first.
        forecaster: the Newton form through `history` (None before the first computed step).
        scale: ``mean|hidden after the blocks|`` at the last computed step (errors are relative
            to it).
        guard: the run-time guard's error estimate.
        previous_output: (rows, ...) denoiser output of the previous step (only while the
            backend records changes, `TeaCacheConfig.record_changes`, at level ``max``).
        computed_step: the step index of the last computed step.
        layout: `forward_layout` of the last computed step (rows of different sizes share a
            padded layout that changes with the batch; cached tensors of another layout are
            never reused).
    """

    num_steps: int
    level: CacheLevel
    timesteps: tuple[float, ...] = ()
    step: int = 0
    accumulated: float = 0.0
    since_compute: int = 0
    skipped: int = 0
    previous_modulated: torch.Tensor | None = None
    history: tuple[tuple[float, torch.Tensor], ...] = ()
    forecaster: Forecaster | None = None
    scale: float = 1.0
    guard: GuardState = GuardState()
    previous_output: torch.Tensor | None = None
    computed_step: int = 0
    layout: tuple | None = None

    @property
    def previous_residual(self) -> torch.Tensor | None:
        """The last computed step's residual (None before the first)."""
        return self.history[-1][1] if self.history else None

    def weight(self, step: int) -> float:
        """Step `step`'s share of the trajectory: ``|t_step - t_step+1| / t_0`` (``t_n = 0``)."""
        t = self.timesteps
        if not t or not t[0]:
            return 1.0 / max(self.num_steps, 1)
        following = t[step + 1] if step + 1 < len(t) else 0.0
        return abs(t[step] - following) / abs(t[0])


@dataclass
class _Decision:
    compute: bool
    accumulated: float
    step_error: float = 0.0
    weight: float = 0.0


def rescale(coefficients: tuple[float, ...], x: float) -> float:
    """Evaluate the polynomial (highest degree first) at `x` (Horner)."""
    y = 0.0
    for c in coefficients:
        y = y * x + c
    return y


def magnitude_ratio(log_norms: tuple[float, ...], step: int, since: int, num_steps: int) -> float:
    """MagCache's magnitude ratio (arXiv:2506.09045) of the blocks' residual between steps
    `since` and `step` of a `num_steps` schedule: ``exp(M(step) - M(since))``, where ``M`` is
    the calibrated log residual norm curve (`log_norms`, evenly spaced over an uncached
    schedule's steps) linearly interpolated at the steps' positions ``step / (num_steps - 1)``
    (so ratios over a span telescope the same for any step count)."""

    def curve(position: float) -> float:
        x = position * (len(log_norms) - 1)
        k = min(int(x), len(log_norms) - 2)
        return log_norms[k] + (x - k) * (log_norms[k + 1] - log_norms[k])

    if len(log_norms) < 2 or num_steps < 2:
        return 1.0
    last = num_steps - 1
    return math.exp(curve(min(step, last) / last) - curve(min(since, last) / last))


def residual_log_norm(residual: torch.Tensor) -> float:
    """``log`` of the mean per-token L2 norm (last axis) of a (rows, N, D) residual."""
    return math.log(max(float(residual.float().norm(dim=-1).mean()), 1e-30))


def forward_layout(batch: "StepBatch", hidden_states: torch.Tensor) -> tuple:
    """How a forward of `batch` lays out each row's tokens: the denoiser input's shape after
    the row dim (the padded latent grid, or a packed family's padded sequence) and the largest
    row's latent area ``max h * w`` (volume ``F * h * w`` for video;
    `diffserve.pipelines.token_spans.LATENT_SIZE`; None when the forward carries no sizes): the token slots every row's tokens sit in, its own grid
    when all rows have one size, else SD3's strip as long as the largest row
    (`token_spans.TokenLayout`). A request's cached residuals and outputs are tensors of the
    layout they were computed in, so a request whose batch changed layout (a row of another
    size joined or left) cannot reuse them. The largest row keeps its layout when smaller rows
    join or leave (its tokens are laid out in raster order either way), so it keeps its cache.
    Two SD3 batches can pad to one grid with strips of different lengths (8x4 with 4x8 vs
    8x8): the second half tells them apart. Edits (`token_spans.REFERENCE_TOKENS`): the
    sequence is the padded noisy tokens then the padded reference tokens, and the largest row
    area fixes the first segment, so the pair also fixes the reference segment's length (a
    row keeps its cache when it has both the largest output and the largest reference)."""
    sizes = batch.row_data.get(LATENT_SIZE) if batch.row_data else None
    return tuple(hidden_states.shape[1:]), (max(math.prod(s) for s in sizes) if sizes else None)


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``mean|current - previous| / mean|previous|`` as a Python float."""
    return float((current - previous).abs().mean() / previous.abs().mean())


class TeaCacheBackend(CacheBackend):
    """The ``teacache`` backend (see the module docstring).

    Args:
        adapter: the loaded pipeline adapter (its capabilities must declare a TeaCache split).
        config: validated options.

    Raises:
        InvalidRequestError: the model family has no TeaCache split, or the folder's levels
            are malformed.
    """

    name = "teacache"

    def __init__(self, adapter: "PipelineAdapter", config: TeaCacheConfig):
        super().__init__()
        support = adapter.capabilities.teacache
        if support is None:
            raise InvalidRequestError(
                "cache_backend", "teacache",
                f"a backend {adapter.pipeline_class_name} supports (teacache has no forward split for it)")
        self.split = support.split
        self.coefficients = config.coefficients or support.coefficients
        self.rel_l1_thresh = support.rel_l1_thresh if config.rel_l1_thresh is None else config.rel_l1_thresh
        self.source = support.source if config.coefficients is None else "cache_config"
        self.warmup_steps = config.warmup_steps
        self.record_changes = config.record_changes
        #: (input change, output change) per recorded step (`TeaCacheConfig.record_changes`).
        self.changes: list[tuple[float, float]] = []
        self.levels: dict[str, CacheLevel] = levels_with(support.levels, config.levels,
                                                           fields=("teacache.cache_quality", "cache_config.levels"))
        self.residual_log_norms = support.residual_log_norms
        for level in self.levels.values():
            if level.forecast == "magnitude" and not self.residual_log_norms:
                mine = ((config.levels or {}).get(level.name) or {}).get("forecast") == "magnitude"
                source = "cache_config.levels" if mine else "teacache.cache_quality"  # else the folder's
                raise InvalidRequestError(f"{source}.{level.name}.forecast", "magnitude",
                                          "taylor: magnitude forecasts need the model's residual_log_norms (run "
                                          "diffserve calibrate-cache on the folder)")
        #: (num_steps, step, log residual norm) per recorded step (`TeaCacheConfig.record_changes`).
        self.residual_norms: list[tuple[int, int, float]] = []
        self.levels["custom"] = CacheLevel("custom", order=0, interval=0, rel_l1_thresh=self.rel_l1_thresh,
                                           budget=math.inf, warmup_steps=config.warmup_steps)
        if config.cache_quality is not None:
            self.default_level = config.cache_quality
        else:
            self.default_level = "custom" if config.rel_l1_thresh is not None else "balanced"

    def level(self, cache_quality: str | None) -> CacheLevel:
        """The `CacheLevel` of a request's ``cache_quality`` (None: the engine's default)."""
        return self.levels[cache_quality or self.default_level]

    def check_params(self, params) -> None:
        """Every level of `CACHE_QUALITY_LEVELS` is served (validated by `SamplingParams`)."""

    def reset(self, state: "RequestState") -> None:
        """Fresh `TeaCacheState` for the request at its level (no residual, zero estimate)."""
        timesteps = tuple(float(t) for t in state.timesteps) if state.timesteps is not None else ()
        state.extra[STATE_KEY] = TeaCacheState(num_steps=state.num_steps, level=self.level(state.params.cache_quality),
                                               timesteps=timesteps)

    def save(self, states: list["RequestState"]) -> Any:
        """Copies of the requests' `TeaCacheState` (its tensors are replaced, never written in
        place, so a shallow copy keeps them) and the skip counters."""
        return ([copy.copy(s.extra[STATE_KEY]) for s in states], self.transformer_calls, self.skipped,
                len(self.changes), len(self.residual_norms))

    def restore(self, states: list["RequestState"], saved: Any) -> None:
        """Put back the `save` copies and counters."""
        copies, self.transformer_calls, self.skipped, recorded, norms = saved
        del self.changes[recorded:], self.residual_norms[norms:]
        for state, st in zip(states, copies):
            state.extra[STATE_KEY] = st

    def request_summary(self, state: "RequestState") -> dict[str, Any] | None:
        """The request's level, skipped steps and final error estimate (see
        `CacheBackend.request_summary`)."""
        st = state.extra.get(STATE_KEY)
        if st is None:
            return None
        return {"cache_quality": st.level.name, "skipped_steps": st.skipped,
                "error_estimate": st.guard.estimate, "check_steps": st.guard.checks}

    def _timestep(self, st: TeaCacheState) -> float:
        return st.timesteps[st.step] if st.step < len(st.timesteps) else float(st.step)

    def _ratio(self, st: TeaCacheState) -> float:
        """The magnitude ratio from the request's last computed step to its current one."""
        return magnitude_ratio(self.residual_log_norms, st.step, st.computed_step, st.num_steps)

    def _predict(self, st: TeaCacheState) -> torch.Tensor:
        """The request's forecast (residual or output) at its current step."""
        if st.level.forecast == "magnitude":
            return st.previous_residual * self._ratio(st)
        return st.forecaster.predict(self._timestep(st))

    def _decide(self, st: TeaCacheState, modulated: torch.Tensor | None, layout: tuple) -> _Decision | None:
        """One request's decision at its current step; None when it needs the modulated input
        and `modulated` is None (the forward's embedding has not run yet). A step whose input
        `layout` differs from the last computed one's (a mixed-size batch padded otherwise)
        computes."""
        level = st.level
        if (not level.skips or st.step < level.warmup_for(st.num_steps) or st.step >= st.num_steps - 1
                or st.forecaster is None or st.layout != layout):
            return _Decision(True, 0.0)
        remainder = st.forecaster.remainder(self._timestep(st))
        accumulated = 0.0
        if level.target == "residual" or math.isfinite(level.rel_l1_thresh) or remainder is None:
            if modulated is None:
                return None
            if st.previous_modulated is None or st.previous_modulated.shape != modulated.shape:
                return _Decision(True, 0.0)
            # A fitted polynomial can dip below 0 near x = 0; a change is never negative.
            accumulated = st.accumulated + max(0.0, rescale(
                self.coefficients, relative_l1(modulated, st.previous_modulated)))
            if accumulated >= level.rel_l1_thresh:  # TeaCache: the input moved too far
                return _Decision(True, 0.0)
        if level.interval and st.since_compute + 1 >= level.interval_for(st.num_steps):  # a check step
            return _Decision(True, 0.0)
        if level.forecast == "magnitude":  # MagCache's error of the scaled residual
            step_error = abs(1.0 - self._ratio(st))
        else:
            step_error = accumulated if remainder is None else remainder / st.scale
        weight = st.weight(st.step)
        if math.isfinite(level.budget) and not st.guard.allows(step_error, weight, level.budget):
            return _Decision(True, 0.0)  # the guard: skipping would exceed the budget
        return _Decision(False, accumulated, step_error, weight)

    def denoise(self, adapter: "PipelineAdapter", batch: "StepBatch") -> torch.Tensor:
        """The adapter's forward of the batch where each request computes its blocks or
        forecasts its residual; returns what `PipelineAdapter.denoise` returns."""
        return adapter.denoise(batch, call=lambda b, kwargs: self._forward(adapter.denoiser, b, kwargs))

    def _forward(self, model, batch: "StepBatch", kwargs: dict) -> torch.Tensor:
        split = self.split
        states = [s.extra[STATE_KEY] for s in batch.states]
        layout = forward_layout(batch, kwargs["hidden_states"])
        early = [self._decide(st, None, layout) for st in states]
        if all(d is not None and not d.compute and st.level.target == "output" for st, d in zip(states, early)):
            return self._forecast_all(batch, states, early)  # nothing to run: not even the embedding
        hidden, context, modulated = split.embed(model, kwargs)
        rows = [batch.request_rows(i).to(hidden.device) for i in range(len(batch.states))]
        decisions = [self._decide(st, modulated[index], layout) for st, index in zip(states, rows)]
        computing = [i for i, d in enumerate(decisions) if d.compute]
        if len(computing) == len(states):
            out_hidden = computed = split.blocks(model, hidden, context)
            computed_rows = {i: rows[i] for i in computing}
        else:
            computed = None
            computed_rows = {}
            if computing:
                index = torch.cat([rows[i] for i in computing])
                # per-row data (LoRA adapters, ...) follows the rows computed (host indices: no sync)
                narrow = (narrowed_rows(torch.cat([batch.request_rows(i) for i in computing]))
                          if batch.row_data else contextlib.nullcontext())
                with narrow:
                    computed = split.blocks(model, hidden[index], split.select_rows(context, index))
                offset = 0
                for i in computing:
                    n = len(rows[i])
                    computed_rows[i] = torch.arange(offset, offset + n, device=hidden.device)
                    offset += n
            out_hidden = hidden.clone()
            for i, index in enumerate(rows):
                if i in computed_rows:
                    out_hidden[index] = computed[computed_rows[i]]
                elif states[i].level.target == "residual":
                    out_hidden[index] = hidden[index] + self._predict(states[i])
        output = split.head(model, out_hidden, context)
        for i, (st, d) in enumerate(zip(states, decisions)):
            if not d.compute and st.level.target == "output":
                output[rows[i]] = self._predict(st).to(output.dtype)

        # Commit the new per-request state only once the whole forward succeeded.
        for i, (st, d) in enumerate(zip(states, decisions)):
            if d.compute:
                self._computed(st, hidden[rows[i]], computed[computed_rows[i]], output[rows[i]], layout)
            else:
                self.skipped += 1
                st.skipped += 1
                st.since_compute += 1
                st.guard = st.guard.skipped(d.step_error, d.weight)
            st.accumulated = d.accumulated
            if self.record_changes and st.level.name == "max":
                if st.previous_output is not None:
                    self.changes.append((relative_l1(modulated[rows[i]], st.previous_modulated),
                                         relative_l1(output[rows[i]], st.previous_output)))
                st.previous_output = output[rows[i]].clone()
                residual = computed[computed_rows[i]] - hidden[rows[i]]
                self.residual_norms.append((st.num_steps, st.step, residual_log_norm(residual)))
            st.previous_modulated = modulated[rows[i]].clone()
            st.step += 1
        self.transformer_calls += len(states)
        return output

    def _forecast_all(self, batch: "StepBatch", states: list[TeaCacheState], decisions: list[_Decision]):
        """The step of a batch whose every request skips and forecasts its output: the
        forecasts laid out over the batch's rows, no denoiser call."""
        forecasts = [self._predict(st) for st in states]
        rows = [batch.request_rows(i).to(forecasts[0].device) for i in range(len(states))]
        output = forecasts[0].new_empty((sum(len(r) for r in rows), *forecasts[0].shape[1:]))
        for index, forecast, st, d in zip(rows, forecasts, states, decisions):
            output[index] = forecast
            self.skipped += 1
            st.skipped += 1
            st.since_compute += 1
            st.guard = st.guard.skipped(d.step_error, d.weight)
            st.step += 1
        self.transformer_calls += len(states)
        return output

    def _computed(self, st: TeaCacheState, before: torch.Tensor, after: torch.Tensor, output: torch.Tensor,
                  layout: tuple) -> None:
        """Book a computed step: the check of the forecast (when one existed), the new
        residual (or output) in the history (restarted when the `layout` changed), the
        forecaster refitted."""
        if st.layout != layout:  # a history in another padded layout: start over
            st.history, st.forecaster, st.layout = (), None, layout
        residual = after - before if st.level.target == "residual" else output
        t = self._timestep(st)
        measured = predicted = None
        if st.level.skips and st.forecaster is not None and st.since_compute > 0:
            measured = float((self._predict(st) - residual).abs().mean()) / st.scale
            remainder = st.forecaster.remainder(t)
            predicted = None if remainder is None else remainder / st.scale
        if st.level.forecast == "magnitude" and measured is not None:
            predicted = abs(1.0 - self._ratio(st))
        st.guard = st.guard.computed(measured, predicted)
        st.since_compute = 0
        st.computed_step = st.step
        if not st.level.skips:
            return
        st.scale = max(float((after if st.level.target == "residual" else output).abs().mean()), 1e-12)
        st.history = (st.history + ((t, residual.clone()),))[-(st.level.order + 2):]
        st.forecaster = Forecaster.fit(list(st.history), st.level.order)

    def stats(self) -> dict[str, Any]:
        """`CacheBackend.stats` plus the threshold, the coefficients' source and the default
        quality level; with ``record_changes``, ``changes``: the recorded ``[input change,
        output change]`` pairs (floats, relative L1) in the order they were taken, and
        ``residual_norms``: ``[num_steps, step, log residual norm]`` of every computed step of a
        ``max`` request (`residual_log_norm`)."""
        stats = {**super().stats(), "rel_l1_thresh": self.rel_l1_thresh, "coefficients_source": self.source,
                 "default_cache_quality": self.default_level}
        if self.record_changes:
            stats["changes"] = [list(point) for point in self.changes]
            stats["residual_norms"] = [list(point) for point in self.residual_norms]
        return stats
