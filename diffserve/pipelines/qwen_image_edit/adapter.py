"""Adapter for Qwen-Image-Edit (`QwenImageEditPipeline` folders): Qwen-Image conditioned on one
input image (Qwen team 2025, arXiv:2508.02324).

The input image enters twice, as in diffusers' `QwenImageEditPipeline`:

1. as image tokens through the Qwen2.5-VL encoder: the prompt template holds
   ``<|vision_start|><|image_pad|><|vision_end|>``, the Qwen2-VL processor expands the pad token
   to one token per 2x2 merged 14-pixel patch and the vision tower fills them in;
2. as VAE latents (``latent_dist.mode()``, normalised, packed) appended to the noisy latents
   along the sequence at every step (``img_shapes`` holds both grids); the prediction for the
   appended tokens is dropped.

Sizes (diffusers' rule): the input image is always resized to ``calculate_dimensions(1024 * 1024,
w / h)``, about 1 megapixel at its own aspect ratio in multiples of 32 pixels, for both the VL
encoder and the VAE, whatever the output size. The output size is the request's
``height``/``width``. diffusers defaults it to that calculated size; in diffserve the engine fills
an unset size from the `ModelSpec` before any adapter sees the image, so an unset size is the
folder's default (1024x1024, the calculated size of a square input): pass ``height``/``width``
(e.g. `output_size`) to follow the input's aspect ratio.

Requests with different input aspect ratios (different reference token counts) and different
output sizes share a forward (`mixed_sizes`, `qwen_image/mixed_sizes.py`): the target tokens are
right-padded to the batch's longest, the reference tokens follow them right-padded to the
longest reference, and each row gets diffusers' RoPE over its own two ``img_shapes`` (target at
frame 0, reference at frame 1, text after the larger grid) and masks its padded keys; in eager
forwards each block runs once per (target, reference, text) token count on real tokens only
(`length_groups`, `QwenImageAdapter.setup`). With mixing off (``--no-mixed-sizes``, Ulysses,
``zero_cond_t`` transformers) the output size and the calculated input size are in the batch
key. Text (prompt + vision tokens) is padded with a mask
as in text-to-image. The prompt-embedding cache key holds a SHA-256 digest of the input
image's pixels (the encoding depends on them). ``max_sequence_length`` is refused: diffusers'
edit pipeline never cuts its text.

The Qwen2-VL processor of a folder is loaded with transformers' PIL image backend
(`Qwen2VLImageOnlyProcessor`): transformers 5.24 cannot load a ``Qwen2VLProcessor`` without
torchvision (its video processor needs it), and the PIL backend keeps pre-processing identical
with or without torchvision installed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from transformers import Qwen2Tokenizer, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from diffserve.core.errors import InvalidRequestError
from diffserve.pipelines.base import RequestState
from diffserve.pipelines.qwen_image.adapter import QwenImageAdapter
from diffserve.pipelines.qwen_image.mixed_sizes import set_token_span
from diffserve.pipelines.text_encoding import TextEncoder

#: diffusers' QwenImageEditPipeline resizes the input image to this area (pixels).
TARGET_AREA = 1024 * 1024


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    """A ``Qwen2VLProcessor`` for text and images only (no video processor, so no torchvision).

    Text and image processing are the parent's (``<|image_pad|>`` expansion, ``pixel_values``,
    ``image_grid_thw``); passing ``videos`` raises.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        """Tokenize ``text`` and process ``images`` as ``Qwen2VLProcessor`` does.

        Raises:
            ValueError: ``videos`` given (this processor has no video processor).
        """
        if videos is not None:
            raise ValueError("videos: this Qwen2-VL processor has no video processor (it needs torchvision)")
        return super().__call__(images=images, text=text, **kwargs)


def load_qwen2vl_processor(folder: Path) -> Qwen2VLImageOnlyProcessor:
    """An image-only Qwen2-VL processor from a ``processor/`` folder (tokenizer files plus
    ``preprocessor_config.json`` or ``processor_config.json``), with the PIL image backend."""
    folder = Path(folder)
    return Qwen2VLImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                                     tokenizer=Qwen2Tokenizer.from_pretrained(folder))


def input_size(image) -> tuple[int, int]:
    """(height, width) in pixels the input image is resized to (diffusers' rule, see the
    module docstring)."""
    width, height, _ = calculate_dimensions(TARGET_AREA, image.size[0] / image.size[1])
    return height, width


def output_size(image, factor: int = 16) -> tuple[int, int]:
    """diffusers' default output (height, width) for an input image: `input_size` floored to
    multiples of `factor` pixels."""
    height, width = input_size(image)
    return height // factor * factor, width // factor * factor


def image_digest(image) -> str:
    """SHA-256 of a PIL image's mode, size and pixels (its identity in the prompt cache)."""
    digest = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class QwenImageEditAdapter(QwenImageAdapter):
    """Step-contract adapter over a diffusers `QwenImageEditPipeline`.

    Tensors as `QwenImageAdapter`, plus per branch the packed input-image latents
    ``image_latents`` (N, (H_in/16)*(W_in/16), 4*C_latent), appended to the latents' tokens in
    the forward (`appended_latents`); per branch ``img_shapes`` holds ``[(1, H/16, W/16), (1,
    H_in/16, W_in/16)]`` per row and the text includes the image's vision tokens.
    """

    pipeline_class_name = "QwenImageEditPipeline"
    pipeline_class: type = QwenImageEditPipeline
    # diffusers' QwenImageEditPipeline.__call__ defaults (it never cuts its text: no text budget)
    sampling_defaults = {"num_inference_steps": 50, "true_cfg_scale": 4.0}
    image_input = "required"
    appended_latents = "image_latents"

    @classmethod
    def component_loaders(cls):
        return {"processor": load_qwen2vl_processor}

    def setup(self) -> dict[str, Any]:
        """`QwenImageAdapter`'s, without a text budget (the text is never cut)."""
        limits = super().setup()
        for name in ("max_sequence_length_limit", "max_prompt_tokens"):
            limits.pop(name)
        return limits

    def make_text_encoder(self) -> TextEncoder:
        """Encodes text with the input image; the only token bound is the transformer's RoPE
        table (longer text is refused at prepare, never cut)."""
        rope_positions = self.pipe.transformer.pos_embed.pos_freqs.shape[0]
        return TextEncoder(self, self._encode_text, [(self.pipe.tokenizer, rope_positions)])

    def image_size(self, image) -> tuple[int, int]:
        """The input image's resized size (part of the batch key only with mixing off)."""
        return input_size(image)

    def prompt_is_truncated(self, prompt: str, max_sequence_length: int | None = None) -> bool:
        """Never: diffusers' edit pipeline keeps the whole text."""
        return False

    def _encode_text(self, text: str, max_sequence_length: int | None, image=None):
        """diffusers' encoding of one text with the resized input image: prompt_embeds
        (1, L_text, D_text), the vision tokens included."""
        embeds, _ = self.pipe.encode_prompt(prompt=text, image=image, device=self.device, num_images_per_prompt=1)
        return (embeds,)

    def prepare_request(self, state: RequestState) -> None:
        """Resize the input image, encode the texts with it (cached under its digest), VAE-encode
        it and draw the latents exactly as diffusers does; own scheduler as text-to-image
        (``mu`` from the output's token count only).

        Raises:
            InvalidRequestError: the text (with its vision tokens) does not fit the transformer's
                RoPE table at this size.
        """
        p, pipe = state.params, self.pipe
        n = p.num_images_per_prompt
        image = state.inputs.images[0]
        height_in, width_in = input_size(image)
        prompt_image = pipe.image_processor.resize(image, height_in, width_in)
        pixels = pipe.image_processor.preprocess(prompt_image, height_in, width_in).unsqueeze(2)
        f = pipe.vae_scale_factor * 2
        shapes = [(1, p.height // f, p.width // f), (1, height_in // f, width_in // f)]
        branches = self.text_branches(state, extra_key=("image", image_digest(image)), image=prompt_image)
        for branch in branches:
            self._check_text_fits(branch["encoder_hidden_states"].shape[1], shapes)
        state.latents, image_latents = pipe.prepare_latents(
            pixels, n, pipe.transformer.config.in_channels // 4, p.height, p.width,
            branches[-1]["encoder_hidden_states"].dtype, self.device, state.generator)
        state.branches = [{**branch, "img_shapes": [shapes] * n, "image_latents": image_latents}
                          for branch in branches]
        self.set_timesteps(state, image_seq_len=state.latents.shape[1])
        set_token_span(state, shapes[0], self.mixed_sizes, reference=shapes[1], reference_tokens=image_latents.shape[1])

    def _check_text_fits(self, text_len: int, shapes: list[tuple[int, int, int]]) -> None:
        rope_positions = self.pipe.transformer.pos_embed.pos_freqs.shape[0]
        first_text_position = max(max(h // 2, w // 2) for _, h, w in shapes)
        if first_text_position + text_len > rope_positions:
            raise InvalidRequestError("prompt", f"{text_len} tokens with the image",
                                      f"at most {rope_positions - first_text_position} tokens with the image "
                                      "(the transformer's RoPE table at this size)")
