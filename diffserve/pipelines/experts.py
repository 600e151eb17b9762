"""Expert routing by noise level, a strategy a family declares (`PipelineAdapter.expert_routing`):
two denoisers of the same architecture split the schedule at a timestep boundary.

Wan 2.2 A14B (Wan team 2025, arXiv:2503.20314, the mixture-of-experts design; diffusers'
`WanPipeline` with ``transformer_2`` and ``boundary_ratio``): the high-noise expert denoises the
steps whose timestep is >= ``boundary_ratio * num_train_timesteps`` with ``guidance_scale``,
the low-noise expert the rest with ``guidance_scale_2``. A request's expert changes while it
runs, so it is its *step key*: the runner reports it, the request scheduler never batches
requests on different experts together, and the forward's expert is an input of the denoiser
call (``expert``, so a captured CUDA graph is one expert's).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffserve.pipelines.request_state import RequestState

#: ``RequestState.extra`` key: the number of leading steps the first (high-noise) expert runs.
HIGH_NOISE_STEPS = "high_noise_steps"


class ExpertRouting:
    """Route each step to the expert of its noise level (see the module docstring).

    Args:
        experts: [high-noise, low-noise] denoisers.
        boundary: the timestep at and above which the high-noise expert runs.

    Attributes:
        module: both experts as one ``nn.ModuleList`` (what regional compile, offload and sleep
            see as the denoiser).
    """

    #: The guidance field of the second expert (a `ModelSpec` default; refused otherwise).
    fields = ("guidance_scale_2",)

    def __init__(self, experts: Sequence[torch.nn.Module], boundary: float):
        if len(experts) != 2:
            raise ValueError(f"expert routing needs 2 experts, got {len(experts)}")
        self.experts = list(experts)
        self.boundary = boundary
        self.module = torch.nn.ModuleList(self.experts)

    def start(self, state: "RequestState") -> None:
        """Fix the request's switch step from its new schedule (the timesteps decrease: the
        first k steps are the high-noise expert's), so a step never reads a timestep back from
        the device to route."""
        state.extra[HIGH_NOISE_STEPS] = int((state.timesteps.double() >= self.boundary).sum())

    def expert(self, state: "RequestState") -> int:
        """0 (high noise) while the step's timestep >= the boundary, else 1."""
        return 0 if state.step_index < state.extra[HIGH_NOISE_STEPS] else 1

    def step_key(self, state: "RequestState") -> Hashable:
        """The expert of the request's next step; None once it is done."""
        return None if state.done else self.expert(state)

    def batch_expert(self, states: Sequence["RequestState"]) -> int:
        """The one expert of a batch's requests.

        Raises:
            ValueError: the batch mixes experts (the request scheduler keeps them apart).
        """
        experts = {self.expert(s) for s in states}
        if len(experts) > 1:
            raise ValueError("requests on different experts cannot share a forward")
        return experts.pop()

    def guidance_weights(self, states: Sequence["RequestState"]) -> list[float]:
        """Each request's CFG weight on its current expert: ``guidance_scale`` on the
        high-noise one, ``guidance_scale_2`` on the low-noise one."""
        return [s.params.guidance_scale if self.expert(s) == 0 else s.params.guidance_scale_2 for s in states]


__all__ = ["ExpertRouting", "HIGH_NOISE_STEPS"]
