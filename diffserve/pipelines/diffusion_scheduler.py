"""Per-request diffusion schedulers and the batched denoising step (shared by every family).

Every request gets its own diffusion-scheduler instance (built from the folder's scheduler
config), so stateful multistep schedulers (DPM-Solver++, UniPC, PNDM) keep their history per
request. For the flow-matching Euler scheduler (SD3, Flux, Qwen-Image) the update is stateless,
``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v`` (Lipman et al. 2023; Esser et al. 2024), so the
whole batch steps in ONE tensor expression over per-row sigma differences instead of one
``scheduler.step`` call per request; requests then record their sigma schedule in
``RequestState.sigmas``.

A family declares how its requests step (`Stepping`): flow-matching families the batched Euler
step (`FLOW_MATCH_EULER`; a request whose scheduler is not a plain flow-matching Euler one steps
with its own scheduler), discrete-time UNet families their scheduler's own step per request on
scaled model inputs, with ``eta`` and the request's generator where the step takes them
(`PER_REQUEST`).

How a request steps is per-request data, never part of the batch key: requests with different
schedulers (per-request samplers, `diffserve.pipelines.samplers`) share one forward, and
`step_batch` steps a mixed batch row by row (each flow-matching Euler request by its sigma
difference, each other request by its scheduler's ``step``).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffserve.pipelines.step_batch import StepBatch


def new_scheduler(template: Any) -> Any:
    """A fresh, independent copy of `template` (one per request; ``set_timesteps`` then gives
    it its own schedule and state): every attribute deep-copied except the config, which
    diffusers keeps in an immutable ``FrozenDict`` and is shared. 1.3-2x cheaper than a whole
    deep copy (most of whose objects are the config's) and 4-6x cheaper than ``from_config``,
    which re-validates the config for every request. Tensor attributes (timesteps, sigmas) are
    cloned rather than deep-copied (same independence, a fraction of the cost)."""
    config = template.__dict__.get("_internal_dict")
    new = copy.copy(template)
    memo: dict[int, Any] = {id(config): config}
    for value in template.__dict__.values():
        if isinstance(value, torch.Tensor):
            memo[id(value)] = value.clone()  # ~20x cheaper than Tensor.__deepcopy__, equally independent
    new.__dict__ = {k: copy.deepcopy(v, memo) for k, v in template.__dict__.items()}
    return new


def batchable_sigmas(scheduler: Any, num_steps: int, begin: int = 0) -> torch.Tensor | None:
    """The (num_steps + 1,) float32 sigmas for the batched Euler step when `scheduler` is a plain
    deterministic `FlowMatchEulerDiscreteScheduler` (no stochastic sampling), else None.

    Args:
        scheduler: a scheduler whose ``set_timesteps`` already ran.
        num_steps: steps the request runs.
        begin: index of its first step in the scheduler's schedule (image-to-image starts late).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if type(scheduler) is not FlowMatchEulerDiscreteScheduler or scheduler.config.get("stochastic_sampling"):
        return None
    sigmas = scheduler.sigmas[begin: begin + num_steps + 1]
    if len(sigmas) != num_steps + 1:
        return None
    return sigmas.to(torch.float32)


@dataclass(frozen=True)
class Stepping:
    """How a family's requests take a denoising step (`PipelineAdapter.stepping`).

    Attributes:
        batched_euler: requests whose scheduler is a plain flow-matching Euler one record their
            sigmas (`batchable_sigmas`) and the whole batch steps in one tensor expression
            (`step_batch`); False: every request steps with its scheduler's own ``step``.
        scaled_input: the denoiser sees each request's ``scheduler.scale_model_input(latents,
            t)`` (Euler-type discrete schedulers divide by ``sqrt(sigma^2 + 1)``); False: the
            latents as they are (a repeated batch then feeds the previous step's concatenated
            latents straight in).
        step_arguments: each request's ``scheduler.step`` gets ``eta`` (the request's, 0 by
            default) and the request's generator where its signature takes them (diffusers'
            ``prepare_extra_step_kwargs`` of the SD / SDXL pipelines: DDIM's eta, the noise of
            ancestral and SDE samplers); False: neither (diffusers' flow-matching pipelines
            pass none, so stochastic samplers are not offered there).
    """

    batched_euler: bool = True
    scaled_input: bool = False
    step_arguments: bool = False

    def sigmas(self, scheduler: Any, num_steps: int, begin: int = 0) -> torch.Tensor | None:
        """``RequestState.sigmas`` of a request whose scheduler's ``set_timesteps`` ran:
        `batchable_sigmas`, or None (stepped per request)."""
        return batchable_sigmas(scheduler, num_steps, begin) if self.batched_euler else None

    def takes_eta(self, scheduler: Any) -> bool:
        """Whether a request with `scheduler` can use ``eta`` (the family passes it, and the
        scheduler's ``step`` takes it: DDIM-type schedulers)."""
        return self.step_arguments and "eta" in inspect.signature(scheduler.step).parameters

    def step_kwargs(self, scheduler: Any, generator: Any, eta: float | None) -> dict[str, Any]:
        """``RequestState.step_kwargs`` of a request with `scheduler` (see `step_arguments`):
        ``eta`` (None: diffusers' default 0.0) and `generator` where its ``step`` takes them."""
        if not self.step_arguments:
            return {}
        accepted = inspect.signature(scheduler.step).parameters
        kwargs: dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0 if eta is None else eta
        if "generator" in accepted:
            kwargs["generator"] = generator
        return kwargs


#: Flow-matching families (SD3, Flux, Qwen-Image, Wan): the batched Euler step where it applies.
FLOW_MATCH_EULER = Stepping()
#: Discrete-time UNet families (SD 1.x/2.x, SDXL): each request's scheduler steps it, on
#: scheduler-scaled model inputs.
PER_REQUEST = Stepping(batched_euler=False, scaled_input=True, step_arguments=True)


def step_batch(batch: "StepBatch", guided: torch.Tensor) -> dict[str, BaseException]:
    """One denoising step for every request of `batch`.

    Args:
        guided: (N, ...) guided predictions aligned with ``batch.latents``.

    A batch where some requests record sigmas and others do not (different per-request
    samplers) steps row by row: each request with sigmas by the same Euler update on its own
    rows (its scheduler's internal step counter is never used), each other request by its
    scheduler's ``step``.

    Returns:
        request_id -> exception for requests whose step failed (per-request path only); the
        others advanced by one step. The batched path is all-or-nothing: it raises before any
        request's latents change. From the second step of an unchanged batch on, it updates
        the batch's latents in place (each request's ``latents`` is a view of them): whoever
        keeps a request's latents past a step must copy them (`ModelRunner.snapshot` does).
    """
    states = batch.states
    cache = batch.cache
    cached_deltas = cache is not None and cache.dt_table is not None  # built only when every state has sigmas
    if cached_deltas or all(s.sigmas is not None for s in states):
        if cached_deltas:
            dt = cache.sigma_deltas().view(-1, *([1] * (guided.dim() - 1)))
        elif len(states) == 1:
            s = states[0]
            dt = s.sigmas[s.step_index + 1] - s.sigmas[s.step_index]
        else:
            dt = torch.stack([s.sigmas[s.step_index + 1] - s.sigmas[s.step_index] for s in states])
            dt = dt.to(guided.device)
            if any(n != 1 for n in batch.row_counts):
                dt = dt.repeat_interleave(torch.tensor(batch.row_counts, device=dt.device))
            dt = dt.view(-1, *([1] * (guided.dim() - 1)))
        if cache is not None and batch.latents is cache.latents and cache.latents.dtype == guided.dtype:
            # the batch's own concatenated latents from its previous step, which the states hold
            # views of: step them in place (no new tensor, no per-request split; same arithmetic)
            buffer = cache.latents
            if buffer.dtype == torch.float32:
                buffer.add_(dt * guided)
            else:
                buffer.copy_(buffer.to(torch.float32) + dt * guided)
            for state in states:
                state.step_index += 1
            cache.advance()
            return {}
        new = (batch.latents.to(torch.float32) + dt * guided).to(guided.dtype)
        views = batch.split(new)
        for state, latents in zip(states, views):
            state.latents = latents
            state.step_index += 1
        if cache is not None:
            cache.advance()
            cache.latents, cache.views = new, views
        return {}
    failures: dict[str, BaseException] = {}
    if cache is not None:
        cache.latents, cache.views = None, []
    for state, rows in zip(states, batch.split(guided)):
        try:
            if state.sigmas is not None:  # flow-matching Euler beside requests with other schedulers
                dt = (state.sigmas[state.step_index + 1] - state.sigmas[state.step_index]).to(rows.device)
                state.latents = (state.latents.to(torch.float32) + dt * rows).to(rows.dtype)
            else:
                state.latents = state.scheduler.step(rows, state.timestep, state.latents, **state.step_kwargs,
                                                     return_dict=False)[0]
            state.step_index += 1
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            failures[state.request_id] = exc
    if cache is not None:
        if failures:
            cache.clear()
        else:
            cache.advance()
    return failures

