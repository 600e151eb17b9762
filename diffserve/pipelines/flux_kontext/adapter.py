"""Adapter for FLUX.1 Kontext (`FluxKontextPipeline` folders): image editing with a reference
image.

Kontext (Black Forest Labs 2025, arXiv:2506.15742) is a FLUX.1-dev transformer that reads the
reference image's packed VAE latents concatenated in sequence after the noisy latents, with
position ids ``(1, row, col)`` (first coordinate 1, the noisy latents have 0); the prediction
for the reference tokens is dropped. Everything else is `FluxAdapter`'s (embedded guidance, true
CFG, timesteps from the target's token count only, decode), and the reference is prepared with
diffusers' own `FluxKontextPipeline.prepare_latents` and image processor, so an edit equals
diffusers' for the same seed (tests/pipelines/test_flux_kontext.py).

Size rule (diffserve's, documented in the README):

- the output is exactly ``height`` x ``width`` (multiples of 16; default 1024x1024 or the
  folder's ``generation_config.json``): diffusers' ``max_area=height*width``. diffusers'
  default ``max_area=1024**2`` instead rescales any requested size to ~1 MP;
- the reference image keeps its own size, floored to multiples of 16 (diffusers
  ``_auto_resize=False``): its cost is (H/16)*(W/16) tokens, and an edit at the input's size
  lines the reference up with the output. diffusers' default ``_auto_resize=True`` would resize it
  to the closest of Kontext's ~1 MP training resolutions; resize the image yourself (e.g. to
  1024x1024) to get that behaviour.

Requests with references of the same (floored) size share forwards (the size is part of the
batch key: the reference tokens and their ids are concatenated to every row of the batch).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxKontextPipeline

from diffserve.core.errors import InvalidRequestError
from diffserve.pipelines.base import RequestInputs, RequestState, StepBatch
from diffserve.pipelines.flux.adapter import FluxAdapter
from diffserve.core.sampling_params import SamplingParams


class FluxKontextAdapter(FluxAdapter):
    """Step-contract adapter over a diffusers `FluxKontextPipeline`.

    Tensors (besides `FluxAdapter`'s): per branch ``image_latents`` (N, (h/16)*(w/16), 4C), the
    packed reference latents of an h x w reference; shared ``img_ids`` (noisy then reference
    position ids). The forward's ``hidden_states`` are (rows, N_img + N_ref, 4C); its output is cut
    back to the N_img noisy-latent tokens.
    """

    pipeline_class_name = "FluxKontextPipeline"
    pipeline_class = FluxKontextPipeline
    accepts_images = True

    def reference_size(self, image: Any) -> tuple[int, int]:
        """(height, width) in pixels the reference image is encoded at: its own size floored to
        multiples of 16 (diffusers with ``_auto_resize=False``)."""
        multiple = self.pipe.vae_scale_factor * 2
        height, width = self.pipe.image_processor.get_default_height_width(image)
        return height // multiple * multiple, width // multiple * multiple

    def check_params(self, params: SamplingParams, inputs: RequestInputs | None) -> None:
        """Exactly one input image (the reference), at least 16x16 pixels, and no mask.

        Raises:
            InvalidRequestError: naming ``image`` or ``mask``.
        """
        images = inputs.images if inputs is not None else []
        if len(images) != 1:
            raise InvalidRequestError("image", f"{len(images)} images",
                                      f"exactly one input image ({self.pipeline_class_name} edits a reference image)")
        if inputs.mask is not None:
            raise InvalidRequestError("mask", "<mask>", f"absent: {self.pipeline_class_name} takes no mask")
        height, width = self.reference_size(images[0])
        if height <= 0 or width <= 0:
            w, h = images[0].size
            raise InvalidRequestError("image", f"{w}x{h}", "at least 16x16 pixels (the reference is cut to "
                                      "multiples of 16 pixels)")

    def batch_key(self, params: SamplingParams, inputs: RequestInputs | None = None):
        """`FluxAdapter`'s key plus the reference's encoded size: its tokens and ids are
        concatenated to every row."""
        size = self.reference_size(inputs.images[0]) if inputs is not None and inputs.images else None
        return (*super().batch_key(params, inputs), size)

    def prepare_request(self, state: RequestState) -> None:
        """Encode the prompt(s), VAE-encode the reference (``argmax``: no noise drawn) and draw
        the noisy latents with diffusers' ``prepare_latents``, then set the timesteps from the
        noisy latents' token count, as diffusers does."""
        self.encode_branches(state)
        p, pipe = state.params, self.pipe
        image = state.inputs.images[0] if state.inputs is not None and state.inputs.images else None
        if image is not None:
            height, width = self.reference_size(image)
            image = pipe.image_processor.preprocess(pipe.image_processor.resize(image, height, width), height, width)
        latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            image, p.num_images_per_prompt, self.latent_channels, p.height, p.width, self.embeds_dtype(state),
            self.device, state.generator)
        state.latents = latents
        if image_latents is not None:
            for branch in state.branches:
                branch["image_latents"] = image_latents
            latent_ids = torch.cat([latent_ids, image_ids], dim=0)
        state.shared["img_ids"] = latent_ids
        self.set_timesteps(state, image_seq_len=latents.shape[1])

    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """`FluxAdapter`'s, with the reference latents appended to ``hidden_states`` in sequence."""
        kwargs = super().denoise_kwargs(batch)
        reference = kwargs.pop("image_latents", None)
        if reference is not None:
            kwargs["hidden_states"] = torch.cat([kwargs["hidden_states"], reference], dim=1)
        return kwargs

    def denoise_output(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """The prediction for the noisy-latent tokens only (rows, N_img, 4C)."""
        return out[:, : batch.latents.shape[1]]
