"""Combining guidance branches into one prediction (shared by every family).

- Classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598):
  ``uncond + w * (cond - uncond)``; diffusers' SD / SDXL / SD3 / Wan ``guidance_scale``, and Flux's
  ``true_cfg_scale`` ("true CFG": a real negative branch, unlike Flux-dev's embedded guidance).
- True CFG with norm rescale (Qwen-Image, as diffusers' `QwenImagePipeline`): the combined
  prediction is rescaled per token to the conditional prediction's norm.

Weights are a Python float when every request of the batch shares one (bit-identical to
diffusers), else an (N,) float32 tensor broadcast over each latent row.
"""

from __future__ import annotations

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
