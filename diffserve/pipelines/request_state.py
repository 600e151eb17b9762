"""`RequestState`: one request's tensors and diffusion-scheduler state between its steps (owned
by the model runner, filled by the family's step adapter)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diffserve.core.inputs import RequestInputs
from diffserve.core.sampling_params import SamplingParams


@dataclass
class RequestState:
    """Per-request tensors and diffusion-scheduler state, owned by the model runner.

    Attributes:
        params: resolved `SamplingParams` (no None fields that the model uses).
        inputs: input images / mask, or None for text-to-image.
        generator: CPU `torch.Generator` seeded with ``params.seed``; with several images
            per prompt, a list of one generator per image seeded with
            `SamplingParams.image_seeds` (diffusers' per-image generators: image i is drawn as
            the one-image request with seed + i draws it).
        latents: (num_images, ...) in the family's latent layout (e.g. (N, C, h, w) for SD3,
            packed (N, h*w/4, 4C) for Flux), in the model dtype.
        branches: per guidance branch (unconditional/negative first, conditional last), the
            denoiser inputs of that branch with leading dim num_images (or nested dicts of such).
        shared: denoiser inputs equal for every request of one batch key (e.g. Flux's 2-D
            position ids); taken from the first request of a batch.
        row_data: per-request values that are not denoiser arguments but that the forward
            reads per row (LoRA adapters, Wan's folded context length, a stream chunk's clean
            latent frames): collation lays each out over the request's rows of every branch
            (`diffserve.pipelines.row_data`). Plain hashable values (ints, floats, tuples).
        guidance_scale: weight of the branch combine (CFG / true CFG), 1.0 without.
        scheduler: this request's own diffusion-scheduler instance.
        step_kwargs: extra keyword arguments of its ``scheduler.step`` (eta, generator).
        timesteps: (num_steps,) float tensor, the denoiser's timestep at each step.
        sigmas: (num_steps + 1,) float32 noise levels for the batched flow-matching Euler step
            (None = the scheduler's own `step` is used, per request).
        step_index: denoising steps done.
        extra: room for acceleration backends' and strategies' per-request state.
        chunk_condition: streams: the adapter's conditioning of the current chunk on the
            previous one (e.g. `video_chunks.ChunkCondition`), None for the first chunk and
            for ordinary requests; re-applied after every step.
        context: multi-stage models: the payloads an earlier stage (the AR stage) produced for
            this request, by guidance branch (`diffserve.connector.payload.Payload`), received
            by the runner before `PipelineAdapter.prepare`; None for single-stage models.
    """

    request_id: str
    prompt: str
    params: SamplingParams
    inputs: RequestInputs | None = None
    generator: torch.Generator | list[torch.Generator] | None = None
    latents: torch.Tensor | None = None
    branches: list[dict[str, Any]] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)
    row_data: dict[str, Any] = field(default_factory=dict)
    guidance_scale: float = 1.0
    scheduler: Any = None
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    timesteps: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None
    step_index: int = 0
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    chunk_condition: Any = None
    context: dict[str, Any] | None = None

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    @property
    def done(self) -> bool:
        """All denoising steps have run."""
        return self.timesteps is not None and self.step_index >= len(self.timesteps)

    @property
    def num_images(self) -> int:
        return self.params.num_images_per_prompt

    @property
    def timestep(self) -> torch.Tensor:
        """The current step's timestep (0-dim)."""
        return self.timesteps[self.step_index]

    def release(self) -> None:
        """Drop every tensor this request holds (abort / failure / finish)."""
        self.latents = None
        self.branches = []
        self.shared = {}
        self.row_data = {}
        self.scheduler = None
        self.timesteps = None
        self.sigmas = None
        self.extra = {}
        self.inputs = None
        self.chunk_condition = None
        self.context = None


__all__ = ["RequestState"]
