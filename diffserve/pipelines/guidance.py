"""Guidance: combining the branches into one prediction, and the `Guidance` strategy a family
declares (which fields make branches, which are denoiser inputs, how branches combine).

- Classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598):
  ``uncond + w * (cond - uncond)``; diffusers' SD / SDXL / SD3 / Wan ``guidance_scale``, and Flux's
  ``true_cfg_scale`` ("true CFG": a real negative branch, unlike Flux-dev's embedded guidance).
- True CFG with norm rescale (Qwen-Image, as diffusers' `QwenImagePipeline`): the combined
  prediction is rescaled per token to the conditional prediction's norm.

Weights are a Python float when every request of the batch shares one (bit-identical to
diffusers), else an (N,) float32 tensor broadcast over each latent row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _broadcast(scale: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.view(-1, *([1] * (like.dim() - 1)))
    return scale


def cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``uncond + scale * (cond - uncond)`` for (N, ...) predictions; `scale` a float or (N,)."""
    out = uncond + _broadcast(scale, cond) * (cond - uncond)
    return out.to(cond.dtype)


def cfg_norm_rescaled(uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """True CFG with the combined prediction rescaled to the conditional one's norm over the
    last dim (per token): ``comb * |cond| / |comb|`` (diffusers' `QwenImagePipeline`).

    Args:
        uncond, cond: (N, L, C) predictions (packed latents).
        scale: float or (N,) weights.
    """
    comb = cfg(uncond, cond, scale)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / noise_norm)


def uniform_or_rows(values: list[float], rows) -> float | torch.Tensor:
    """A float when every request uses the same weight, else `rows(values)` ((N,) tensor)."""
    first = values[0]
    if all(v == first for v in values):
        return float(first)
    return rows(values)


@dataclass(frozen=True)
class Guidance:
    """A family's guidance, chosen by declaration (`PipelineAdapter.guidance`): how its
    guidance fields become denoiser rows (branches), per-row inputs and one combined prediction.

    Attributes:
        scale_field: the `SamplingParams` field weighting the negative branch:
            ``"guidance_scale"`` (CFG: two branches when it is > 1, the negative prompt
            defaulting to ``""``) or ``"true_cfg_scale"`` (true CFG: two branches when it is > 1
            and a ``negative_prompt`` is given, even ``""``, as diffusers' Flux and Qwen-Image
            pipelines decide).
        norm_rescale: the combined prediction is rescaled per token to the conditional one's
            norm (`cfg_norm_rescaled`, Qwen-Image).
        embedded: ``guidance_scale`` is an input of the denoiser (a guidance-distilled
            transformer, FLUX.1-dev): every branch gets ``guidance`` (rows,) float32 holding the
            request's value, so requests with different values share a forward.
    """

    scale_field: str = "guidance_scale"
    norm_rescale: bool = False
    embedded: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        """The `SamplingParams` guidance fields the family uses (the others are refused by name)."""
        return (self.scale_field,) + (("guidance_scale",) if self.embedded else ())

    def branches(self, params) -> int:
        """Guidance branches of a request: 2 (negative, then conditional) or 1."""
        scale = getattr(params, self.scale_field)
        if scale is None or scale <= 1.0:
            return 1
        return 2 if self.scale_field == "guidance_scale" or params.negative_prompt is not None else 1

    def weight(self, params) -> float:
        """The request's branch weight (`RequestState.guidance_scale`; unused with one branch)."""
        scale = getattr(params, self.scale_field)
        return 1.0 if scale is None else float(scale)

    def branch_inputs(self, params, num_images: int, device) -> dict[str, torch.Tensor]:
        """Per-branch denoiser inputs of the guidance itself (embedded guidance's ``guidance``
        (num_images,) float32), {} otherwise."""
        if not self.embedded:
            return {}
        return {"guidance": torch.full((num_images,), params.guidance_scale, device=device, dtype=torch.float32)}

    def combine(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        """The guided (N, ...) prediction from the branches' (N, ...) predictions."""
        return cfg_norm_rescaled(uncond, cond, scale) if self.norm_rescale else cfg(uncond, cond, scale)


#: Classifier-free guidance on ``guidance_scale`` (SD, SDXL, SD3, Wan).
CFG = Guidance()
#: True CFG on ``true_cfg_scale`` with a real negative prompt (FLUX.1-schnell).
TRUE_CFG = Guidance("true_cfg_scale")
#: True CFG with norm rescale (Qwen-Image).
TRUE_CFG_NORM_RESCALED = Guidance("true_cfg_scale", norm_rescale=True)
