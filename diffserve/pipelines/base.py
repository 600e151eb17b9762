"""The step contract every pipeline adapter implements (see ARCHITECTURE.md).

An adapter wraps one model family's diffusers components and exposes four operations on a
per-request `RequestState`:

1. `prepare(state)`: encode the prompt, create the request's own diffusion-scheduler instance,
   its timesteps/sigmas and initial latents from its own seeded generator.
2. `denoise(batch)`: ONE transformer/UNet forward over a `StepBatch` gathered from several
   requests that share a batch key (rows carry per-sample timesteps; CFG doubles rows).
3. `step(state, noise_pred_rows)`: CFG combination + one diffusion-scheduler step.
4. `decode(state)`: VAE decode and post-processing.

A whole request is prepare, then denoise+step until done, then decode: the request path and
the step path share one implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from diffserve.sampling_params import ModelSpec, SamplingParams

if TYPE_CHECKING:
    from diffserve.acceleration.prompt_embed_cache import PromptEmbedCache
    from diffserve.runner.step_batch import StepBatch


@dataclass
class RequestState:
    """Per-request tensors and diffusion-scheduler state, owned by the model runner.

    Attributes:
        params: resolved `SamplingParams` (no None fields).
        generator: CPU `torch.Generator` seeded with ``params.seed``.
        latents: (num_images, C, H/f_vae, W/f_vae) in the model dtype.
        model_inputs: per-request row tensors the adapter reuses every step (prompt
            embeddings etc.; CFG rows ordered [unconditional..., conditional...]).
        scheduler: this request's own diffusion-scheduler instance.
        timesteps: (num_inference_steps,) float tensor.
        step_index: denoising steps done.
        extra: room for acceleration backends' per-request state.
    """

    request_id: str
    prompt: str
    params: SamplingParams
    generator: torch.Generator | None = None
    latents: torch.Tensor | None = None
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    scheduler: Any = None
    timesteps: torch.Tensor | None = None
    step_index: int = 0
    prompt_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    @property
    def done(self) -> bool:
        """All denoising steps have run."""
        return self.timesteps is not None and self.step_index >= len(self.timesteps)

    @property
    def rows(self) -> int:
        """Transformer rows this request adds to a step batch (x2 with CFG)."""
        return request_rows(self.params)

    def release(self) -> None:
        """Drop every tensor this request holds (abort / failure / finish)."""
        self.latents = None
        self.model_inputs = {}
        self.scheduler = None
        self.timesteps = None
        self.extra = {}


def request_rows(params: SamplingParams) -> int:
    """Rows of a request in a transformer batch: num_images x (2 if CFG else 1)."""
    return params.num_images_per_prompt * (2 if params.do_classifier_free_guidance else 1)


class PipelineAdapter(ABC):
    """Base class of the model-family adapters (one per diffusers pipeline class).

    Subclasses set `pipeline_class_name` (the ``_class_name`` in ``model_index.json``) and
    build themselves from the loaded components with `from_components`.
    """

    pipeline_class_name: ClassVar[str]
    #: What the model does, as listed in ``GET /v1/models``: ``text-to-image``, ``image-edit``
    #: (an input image to edit), ``text-to-video``.
    capabilities: ClassVar[tuple[str, ...]] = ("text-to-image",)

    device: torch.device
    dtype: torch.dtype
    spec: ModelSpec
    #: LRU of prompt encodings installed by the model runner (None = off); adapters look
    #: their prompt encodings up in it (`diffserve.acceleration.prompt_embed_cache`).
    prompt_embed_cache: "PromptEmbedCache | None" = None

    @classmethod
    @abstractmethod
    def from_components(
        cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype, model_dir: Path
    ) -> "PipelineAdapter":
        """Build the adapter from the loaded components (moved to `device`)."""

    @property
    @abstractmethod
    def denoiser(self) -> torch.nn.Module:
        """The transformer/UNet called once per step (what caches and compile wrap)."""

    @abstractmethod
    def batch_key(self, params: SamplingParams) -> Hashable:
        """Requests with equal keys may share one denoise forward."""

    @abstractmethod
    def prepare(self, state: RequestState) -> None:
        """Encode the prompt, create scheduler/timesteps and the initial latents."""

    @abstractmethod
    def step_inputs(self, state: RequestState) -> dict[str, torch.Tensor]:
        """This request's rows of the next denoise forward (leading dim = `state.rows`)."""

    @abstractmethod
    def denoise(self, batch: "StepBatch") -> torch.Tensor:
        """One denoiser forward on the gathered batch; returns (rows, C, h, w) predictions."""

    @abstractmethod
    def step(self, state: RequestState, noise_pred: torch.Tensor) -> None:
        """Apply CFG to this request's rows and take one diffusion-scheduler step."""

    @abstractmethod
    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Decode `latents` (default: the state's) into images of ``params.output_type``."""

    def enable_context_folding(self) -> bool:
        """Switch on context folding (`diffserve.acceleration.context_folding`) if this model
        has identical placeholder context tokens; returns whether it was enabled."""
        return False

    def prompt_is_truncated(self, prompt: str) -> bool:
        """Whether `prompt` exceeds the text encoder's token limit (it will be truncated)."""
        return False
