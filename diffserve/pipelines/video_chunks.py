"""Chunked video generation: chunk k+1 is conditioned on the end of chunk k.

Two methods, by what the model was trained for:

* **Clean first frame with per-token timesteps** (models whose pipeline config has
  ``expand_timesteps``, the first-frame conditioning of Wan 2.2 TI2V: Wan Team 2025, "Wan: Open
  and Advanced Large-Scale Video Generative Models", arXiv:2503.20314, and diffusers'
  ``WanImageToVideoPipeline`` with ``expand_timesteps``): the known latent frames are the clean
  latents at every step and their patch tokens get timestep 0, the other tokens the step's
  timestep, so the transformer sees a clean conditioning frame as it was trained to (it saw such
  inputs in training: ``training.digits_video.train``'s ``first_frame_prob``). This is
  per-frame noise levels in the sense of Diffusion Forcing (Chen et al. 2024, arXiv:2407.01392).
* **Replacement method** otherwise (any text-to-video model, nothing trained for it): the
  replacement method of autoregressive video extension (Ho et al. 2022, "Video Diffusion
  Models", arXiv:2204.03458, sec. 3.1; the conditional-sampling "imputation" of Song et al. 2021,
  "Score-Based Generative Modeling through Stochastic Differential Equations", arXiv:2011.13456,
  app. I.2; RePaint, Lugmayr et al. 2022, applies it to inpainting). At every denoising step the
  known latents are replaced by a sample of the forward process at the current noise level, here
  flow matching's ``z_sigma = (1 - sigma) * z_0 + sigma * eps``, while the model denoises the
  other frames jointly with them. At the last step (sigma 0) the known latents are exact. Ho et
  al. note that the unknown frames then follow the known ones only loosely (at high noise the
  known frames are mostly noise): measured on the built-in model, the first-frame method keeps
  the digit and its motion across seams far better (README, Streaming video).

Overlap with a causal video VAE (Wan's ``AutoencoderKLWan``): the encoder takes the first frame
of a clip alone (latent frame 0) and every later 4 frames together, so the previous chunk's LAST
decoded frame, re-encoded as a one-frame clip, is exactly a first latent frame; the new chunk's
latent frame 0 is fixed to it. The new chunk's first decoded frame then repeats that frame and
is not emitted again: a stream of K chunks of F frames has ``F + (K - 1) * (F - 1)`` frames.
Timing: the re-encoding is part of the chunk boundary (after the previous chunk's decode), which
runs beside the other requests' denoising steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ChunkCondition:
    """Latent frames of a chunk fixed from the previous chunk (module docstring: the two methods).

    Attributes:
        clean: (N, C, o, h, w) float32: the conditioning frames' latents, normalised as the
            denoiser sees latents.
        noise: (N, C, o, h, w) float32: the fixed epsilon of their forward process (the chunk's
            own initial noise for those frames, so step 0 equals an unconditioned start).
        sigmas: (num_steps + 1,) float32 noise level at each step's input; the last is 0.
        clean_tokens: the clean-first-frame method: the known frames stay clean at every step
            (``noise`` and ``sigmas`` unused) and the denoiser gives their tokens timestep 0
            (the adapter's job); False: the replacement method.
    """

    clean: torch.Tensor
    noise: torch.Tensor
    sigmas: torch.Tensor
    clean_tokens: bool = False

    @property
    def num_frames(self) -> int:
        """o: latent frames fixed at the start of the chunk."""
        return self.clean.shape[2]

    def apply(self, latents: torch.Tensor, step_index: int) -> torch.Tensor:
        """`latents` (N, C, F_lat, h, w) with the first `num_frames` latent frames replaced by
        their forward-process sample at the noise level of step `step_index` (its input; at
        the end of the schedule the clean latents; always the clean latents with
        ``clean_tokens``). Returns a new tensor (never in place: the runner's preview snapshots
        hold the old one)."""
        sigma = 0.0 if self.clean_tokens else float(self.sigmas[min(step_index, len(self.sigmas) - 1)])
        known = ((1.0 - sigma) * self.clean + sigma * self.noise).to(latents.dtype)
        return torch.cat([known, latents[:, :, self.num_frames:]], dim=2)


def per_token_timesteps(timestep: torch.Tensor, known_frames: torch.Tensor | None, latent_frames: int,
                        tokens_per_frame: int) -> torch.Tensor:
    """Per-token timesteps of the first-frame conditioning (Wan 2.2 TI2V, arXiv:2503.20314;
    diffusers' ``expand_timesteps``): every token of a row gets the row's timestep, except the
    tokens of its first ``known_frames`` latent frames (clean conditioning frames), which get 0.
    Used by the Wan adapter at serving time and by the built-in video model's training loss.

    Args:
        timestep: (B,) the rows' timesteps (0..1000).
        known_frames: (B,) long, each row's number of clean latent frames (token frames when the
            patch has a temporal size > 1); None: no row has any.
        latent_frames: F', token frames per row (latent frames / temporal patch size).
        tokens_per_frame: patch tokens per latent frame, (h / p_h) * (w / p_w).

    Returns:
        float32 (B, F' * tokens_per_frame).
    """
    out = timestep.float()[:, None].expand(-1, latent_frames * tokens_per_frame)
    if known_frames is None:
        return out
    token = torch.arange(out.shape[1], device=out.device)
    return out.masked_fill(token[None, :] < (known_frames.to(out.device) * tokens_per_frame)[:, None], 0.0)


def frames_to_video_tensor(frames: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """uint8 frames (F, H, W, 3) as the VAE's input (1, 3, F, H, W) in [-1, 1] (what diffusers'
    `VideoProcessor.preprocess_video` makes of them)."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
    return (video.to(device=device, dtype=torch.float32) / 127.5 - 1.0).to(dtype)
