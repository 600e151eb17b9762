"""Adapter for Stable Diffusion XL folders (`StableDiffusionXLPipeline`).

SDXL (Podell et al. 2023, arXiv:2307.01952): the UNet mechanics of `stable_diffusion/adapter.py`
(per-request classic scheduler, scaled model input, per-request ``scheduler.step``) plus two
CLIP text encoders whose penultimate hidden states are concatenated, the second encoder's
pooled projection and six size/crop "time ids" as ``added_cond_kwargs`` (micro-conditioning).
As in diffusers' ``__call__`` with only ``prompt`` / ``negative_prompt`` given: ``prompt_2`` =
prompt, ``negative_prompt_2`` = negative_prompt; with the folder's
``force_zeros_for_empty_prompt`` (SDXL base: true) a request without a negative prompt gets
zero negative embeddings instead of encoding ""; time ids = original size = target size =
the request's (height, width), crop (0, 0). Default size: ``unet.config.sample_size`` x 8
(1024 for SDXL base).

Decode: ``latents / scaling_factor`` (or ``* latents_std / scaling_factor + latents_mean``
when the VAE config has them); an fp16 VAE with ``force_upcast`` is kept in float32 from load
on (diffusers upcasts it around each decode: the same arithmetic, without moving weights per
request); the invisible watermark if diffusers enables it (``invisible-watermark`` installed).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers import StableDiffusionXLPipeline

from diffserve.core.sampling_params import SamplingParams
from diffserve.pipelines.base import RequestState
from diffserve.pipelines.stable_diffusion.adapter import StableDiffusionAdapter
from diffserve.pipelines.text_encoding import repeat_rows

logging.getLogger("diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl").setLevel(logging.ERROR)


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    """Step-contract adapter over a diffusers `StableDiffusionXLPipeline`.

    Tensors per CFG branch ``[negative, positive]``: ``encoder_hidden_states`` (N, 77, D1 + D2)
    and ``added_cond_kwargs`` = {``text_embeds`` (N, P), ``time_ids`` (N, 6)} (collated as a
    nested dict); latents (N, 4, H/8, W/8).
    """

    pipeline_class_name = "StableDiffusionXLPipeline"
    pipeline_class = StableDiffusionXLPipeline
    # diffusers' StableDiffusionXLPipeline.__call__ defaults
    sampling_defaults = {"num_inference_steps": 50, "guidance_scale": 5.0}
    set_begin_index = True

    def setup(self) -> dict[str, Any]:
        """As SD's; an fp16 VAE with ``force_upcast`` is kept in float32."""
        limits = super().setup()
        vae = self.pipe.vae
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            vae.to(torch.float32)
        return limits

    def max_clip_skip(self) -> int | None:
        return self.clip_layers_skippable(self.pipe.text_encoder, self.pipe.text_encoder_2)

    def _encode_text(self, text: str | list[str], max_sequence_length: int | None, clip_skip: int | None = None):
        """diffusers' SDXL encoding of a text (prompt_2 = text; or of n texts, a row each:
        both CLIPs pad to 77 tokens, so a row equals the text alone), with `clip_skip`:
        prompt_embeds (n, 77, D1 + D2) and pooled (n, P)."""
        pe, _, pooled, _ = self.pipe.encode_prompt(prompt=text, device=self.device, num_images_per_prompt=1,
                                                   do_classifier_free_guidance=False, clip_skip=clip_skip)
        return pe, pooled

    def texts_to_encode(self, prompt: str, params: SamplingParams) -> list[tuple[str, int | None]]:
        """As SD's, without the negative prompt when the folder zeroes an unset one
        (``force_zeros_for_empty_prompt``)."""
        texts = super().texts_to_encode(prompt, params)
        if params.negative_prompt is None and self.pipe.config.force_zeros_for_empty_prompt:
            texts = texts[:1]
        return texts

    def text_branches(self, state: RequestState, **encode: Any) -> list[dict[str, Any]]:
        """Per CFG branch (negative first): text embeddings and ``added_cond_kwargs``, N rows."""
        p = state.params
        pipe = self.pipe
        n = p.num_images_per_prompt
        pe, pooled = self.text.encode(state.prompt, **self.clip_skip_inputs(p))
        encoded = [(pe, pooled)]
        if self.branches(p) == 2:
            if p.negative_prompt is None and pipe.config.force_zeros_for_empty_prompt:
                encoded.insert(0, (torch.zeros_like(pe), torch.zeros_like(pooled)))
            else:
                encoded.insert(0, self.text.encode(p.negative_prompt or ""))  # diffusers: without clip_skip
        projection_dim = (int(pooled.shape[-1]) if pipe.text_encoder_2 is None
                          else pipe.text_encoder_2.config.projection_dim)
        size = (p.height, p.width)
        time_ids = pipe._get_add_time_ids(size, (0, 0), size, dtype=pe.dtype,
                                          text_encoder_projection_dim=projection_dim).to(self.device)
        return [{"encoder_hidden_states": repeat_rows(e, n),
                 "added_cond_kwargs": {"text_embeds": repeat_rows(pool, n), "time_ids": repeat_rows(time_ids, n)}}
                for e, pool in encoded]

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
        if self.pipe.watermark is not None:
            image = self.pipe.watermark.apply_watermark(image)
        return image
