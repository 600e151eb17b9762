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

Requests with references and outputs of different sizes share forwards (`FluxAdapter`'s mixed
sizes, `flux/mixed_sizes.py`): the noisy tokens are right-padded to the batch's longest, the
reference tokens follow them right-padded to the longest reference, and every row rotates both
segments by its own ids (``(0, row, col)`` and ``(1, row, col)``) and masks its padded keys. With
mixing off (``--no-mixed-sizes``, Ulysses) the output and reference sizes are in the batch key.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxKontextPipeline

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import SamplingParams
from diffserve.pipelines.base import RequestInputs, RequestState
from diffserve.pipelines.flux.adapter import FluxAdapter
from diffserve.pipelines.flux.mixed_sizes import set_token_span


class FluxKontextAdapter(FluxAdapter):
    """Step-contract adapter over a diffusers `FluxKontextPipeline`.

    Tensors (besides `FluxAdapter`'s): per branch ``image_latents`` (N, (h/16)*(w/16), 4C), the
    packed reference latents of an h x w reference; shared ``img_ids`` (noisy then reference
    position ids). The forward's ``hidden_states`` are (rows, N_img + N_ref, 4C) (both padded to
    the batch's longest when sizes differ); its output is cut back to the N_img noisy-latent
    tokens (`appended_latents`).
    """

    pipeline_class_name = "FluxKontextPipeline"
    pipeline_class = FluxKontextPipeline
    image_input = "required"
    appended_latents = "image_latents"
    flow_sigmas_from_scheduler = False  # diffusers' Kontext __call__ always passes the linear sigmas

    def image_size(self, image: Any) -> tuple[int, int]:
        """(height, width) in pixels the reference image is encoded at: its own size floored to
        multiples of 16 (diffusers with ``_auto_resize=False``); part of the batch key only
        with mixing off (`mixed_sizes`)."""
        multiple = self.pipe.vae_scale_factor * 2
        height, width = self.pipe.image_processor.get_default_height_width(image)
        return height // multiple * multiple, width // multiple * multiple

    def check_params(self, params: SamplingParams, inputs: RequestInputs | None) -> None:
        """One input image (the reference) of at least 16x16 pixels, and no mask.

        Raises:
            InvalidRequestError: naming ``image`` or ``mask``.
        """
        super().check_params(params, inputs)
        height, width = self.image_size(inputs.images[0])
        if height <= 0 or width <= 0:
            w, h = inputs.images[0].size
            raise InvalidRequestError("image", f"{w}x{h}", "at least 16x16 pixels (the reference is cut to "
                                      "multiples of 16 pixels)")

    def prepare_request(self, state: RequestState) -> None:
        """Encode the prompt(s), VAE-encode the reference (``argmax``: no noise drawn) and draw
        the noisy latents with diffusers' ``prepare_latents``, then set the timesteps from the
        noisy latents' token count, as diffusers does."""
        self.encode_branches(state)
        p, pipe = state.params, self.pipe
        image = state.inputs.images[0]
        height, width = self.image_size(image)
        image = pipe.image_processor.preprocess(pipe.image_processor.resize(image, height, width), height, width)
        latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            image, p.num_images_per_prompt, self.latent_channels, p.height, p.width, self.embeds_dtype(state),
            self.device, state.generator)
        state.latents = latents
        for branch in state.branches:
            branch["image_latents"] = image_latents
        state.shared["img_ids"] = torch.cat([latent_ids, image_ids], dim=0)
        self.set_timesteps(state, image_seq_len=latents.shape[1])
        set_token_span(state, pipe.vae_scale_factor, self.mixed_sizes, reference=(height, width),
                       reference_tokens=image_latents.shape[1])
