"""User classes for the custom-pipeline tests (``custom_pipeline="custom_pipelines:Class"``)."""

from __future__ import annotations

from diffusers import StableDiffusion3Pipeline

from diffserve.pipelines.sd3.adapter import StableDiffusion3Adapter


class NegatedSD3Adapter(StableDiffusion3Adapter):
    """A user step adapter: SD3 whose images come out colour-inverted (1 - pixels), served
    with step batching like any registered adapter."""

    def decode(self, state, latents=None):
        images = super().decode(state, latents)
        return 1.0 - images if state.params.output_type == "np" else images


class NegatedSD3Pipeline(StableDiffusion3Pipeline):
    """A user pipeline with only a diffusers-style ``__call__``: served whole-request."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        if kwargs.get("output_type") == "np":
            out.images = 1.0 - out.images
        return out
