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

The first ``warmup_steps`` steps and the last step always compute. The adapter's split says
what runs outside the blocks (patch/time/text embeddings before, the output head after); those
always run. The backend wraps ``adapter.denoise`` (its ``call`` hook), so the adapter's own
input preparation and output post-processing stay in place.

In a step batch each request decides on its own rows (all guidance branches); the blocks run
only on the rows of the requests that compute, and the others add their own cached residual,
so a request's result equals running it alone with the same settings (within float tolerance
of batching).

Rescaling coefficients come from the adapter (``TeaCacheSupport.coefficients``, per family, or
from the model folder's ``generation_config.json`` ``teacache`` entry, e.g. the built-in digits
model's calibrated preset); calibrate a model with
``python -m training.teacache_calibrate --model DIR``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from diffserve.acceleration.backend import CacheBackend
from diffserve.config import TeaCacheConfig
from diffserve.core.errors import InvalidRequestError
from diffserve.pipelines.row_data import narrowed_rows

if TYPE_CHECKING:
    from diffserve.pipelines.base import PipelineAdapter, RequestState
    from diffserve.pipelines.step_batch import StepBatch

STATE_KEY = "teacache"


@dataclass
class TeaCacheState:
    """One request's TeaCache state (in ``RequestState.extra["teacache"]``).

    Attributes:
        num_steps: the request's denoising steps (the last one always computes).
        step: steps taken so far.
        accumulated: accumulated rescaled distance since the last computed step.
        previous_modulated: (rows, N_img, D) modulated input of the previous step.
        previous_residual: (rows, N_img, D) blocks' residual of the last computed step.
    """

    num_steps: int
    step: int = 0
    accumulated: float = 0.0
    previous_modulated: torch.Tensor | None = None
    previous_residual: torch.Tensor | None = None


def rescale(coefficients: tuple[float, ...], x: float) -> float:
    """Evaluate the polynomial (highest degree first) at `x` (Horner)."""
    y = 0.0
    for c in coefficients:
        y = y * x + c
    return y


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``mean|current - previous| / mean|previous|`` as a Python float."""
    return float((current - previous).abs().mean() / previous.abs().mean())


class TeaCacheBackend(CacheBackend):
    """The ``teacache`` backend (see the module docstring).

    Args:
        adapter: the loaded pipeline adapter (its capabilities must declare a TeaCache split).
        config: validated options.

    Raises:
        InvalidRequestError: the model family has no TeaCache split.
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

    def reset(self, state: "RequestState") -> None:
        """Fresh `TeaCacheState` for the request (no residual, zero accumulated distance)."""
        state.extra[STATE_KEY] = TeaCacheState(num_steps=state.num_steps)

    def save(self, states: list["RequestState"]) -> Any:
        """Copies of the requests' `TeaCacheState` (its tensors are replaced, never written in
        place, so a shallow copy keeps them) and the skip counters."""
        return [copy.copy(s.extra[STATE_KEY]) for s in states], self.transformer_calls, self.skipped

    def restore(self, states: list["RequestState"], saved: Any) -> None:
        """Put back the `save` copies and counters."""
        copies, self.transformer_calls, self.skipped = saved
        for state, st in zip(states, copies):
            state.extra[STATE_KEY] = st

    def _decide(self, st: TeaCacheState, modulated: torch.Tensor) -> tuple[bool, float]:
        """(compute?, new accumulated distance) of one request at its current step."""
        if (st.step < self.warmup_steps or st.step >= st.num_steps - 1
                or st.previous_residual is None or st.previous_modulated is None
                or st.previous_modulated.shape != modulated.shape):
            return True, 0.0
        # A fitted polynomial can dip below 0 near x = 0; a change is never negative.
        accumulated = st.accumulated + max(0.0, rescale(
            self.coefficients, relative_l1(modulated, st.previous_modulated)))
        if accumulated < self.rel_l1_thresh:
            return False, accumulated
        return True, 0.0

    def denoise(self, adapter: "PipelineAdapter", batch: "StepBatch") -> torch.Tensor:
        """The adapter's forward of the batch where each request computes its blocks or
        reuses its cached residual; returns what `PipelineAdapter.denoise` returns."""
        return adapter.denoise(batch, call=lambda b, kwargs: self._forward(adapter.denoiser, b, kwargs))

    def _forward(self, model, batch: "StepBatch", kwargs: dict) -> torch.Tensor:
        split = self.split
        hidden, context, modulated = split.embed(model, kwargs)
        rows = [batch.request_rows(i).to(hidden.device) for i in range(len(batch.states))]
        states = [s.extra[STATE_KEY] for s in batch.states]
        decisions = [self._decide(st, modulated[index]) for st, index in zip(states, rows)]
        computing = [i for i, (compute, _) in enumerate(decisions) if compute]
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
                else:
                    out_hidden[index] = hidden[index] + states[i].previous_residual
        output = split.head(model, out_hidden, context)

        # Commit the new per-request state only once the whole forward succeeded.
        for i, (st, (compute, accumulated)) in enumerate(zip(states, decisions)):
            if compute:
                st.previous_residual = (computed[computed_rows[i]] - hidden[rows[i]]).clone()
            else:
                self.skipped += 1
            st.accumulated = accumulated
            st.previous_modulated = modulated[rows[i]].clone()
            st.step += 1
        self.transformer_calls += len(states)
        return output

    def stats(self) -> dict[str, Any]:
        """`CacheBackend.stats` plus the threshold and the coefficients' source."""
        return {**super().stats(), "rel_l1_thresh": self.rel_l1_thresh, "coefficients_source": self.source}
