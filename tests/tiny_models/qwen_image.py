"""Tiny random-weight ``QwenImagePipeline`` and ``QwenImageEditPipeline`` (Qwen-Image layouts).

Components: ``QwenImageTransformer2DModel`` (MMDiT, 3-D RoPE over ``(frame, row, col)``),
``Qwen2_5_VLForConditionalGeneration`` (text hidden 32, 2 heads of 16, ``mrope_section=[2, 3, 3]``
summing to the rotary half-dim; vision tower 2 blocks, ``out_hidden_size`` = text hidden size), a
``Qwen2Tokenizer`` trained offline on the pipelines' prompt templates
(:func:`tiny_models.components.qwen2_tokenizer`), ``AutoencoderKLQwenImage`` (16 latent channels,
``dim_mult`` of 4 entries = the real 8x spatial down-sampling, the real ``latents_mean``/``std``)
and the real ``FlowMatchEulerDiscreteScheduler`` settings of Qwen/Qwen-Image
(``scheduler/scheduler_config.json``: dynamic shifting, ``base_image_seq_len=256``,
``max_image_seq_len=8192``, ``base_shift=0.5``, ``max_shift=0.9``, ``shift_terminal=0.02``,
exponential time shift). Resolution factor 16 pixels (VAE 8 x 2x2 packing).

The edit folder adds ``processor`` (``Qwen2VLProcessor``: the tokenizer plus a Qwen2-VL image
processor, 14-pixel patches merged 2x2). transformers 5.24 cannot build or load a
``Qwen2VLProcessor`` without torchvision (its video processor needs it, even for images only;
huggingface/transformers#48558), so the folder's ``processor/`` holds the tokenizer and the
image-processor config only, and :func:`load_qwen2vl_processor` (diffserve's own loader for
edit folders, ``diffserve.pipelines.qwen_image_edit.adapter``, re-exported here) builds an image-only
``Qwen2VLProcessor`` (:class:`Qwen2VLImageOnlyProcessor`, PIL backend) from it -- pass it as
``QwenImageEditPipeline.from_pretrained(folder, processor=...)``. It also works on a real
Qwen-Image-Edit folder's ``processor/``. The tiny image processor caps images at 112x112 pixels
(``max_pixels``) so the vision tower sees 8x8 patches (real: 12845056).

Parity notes: diffusers 0.42.1, ``pipelines/qwenimage/pipeline_qwenimage.py`` (``QwenImagePipeline``)
-----------------------------------------------------------------------------------------------------
* Defaults: ``num_inference_steps=50``, ``true_cfg_scale=4.0``, ``negative_prompt=None`` -- so
  by default there is NO guidance at all (only a warning): true CFG needs a negative prompt;
  ``guidance_scale=None`` (used only if ``transformer.config.guidance_embeds``, else ignored with
  a warning), ``max_sequence_length=512`` (``check_inputs`` raises above 1024). ``height``/
  ``width`` default to ``default_sample_size * vae_scale_factor`` = 128 * 8 = 1024 (constant);
  ``vae_scale_factor = 2 ** len(vae.temperal_downsample)`` = 8. Not a multiple of 16: warning only,
  floored (``2 * (size // 16)`` latent pixels).
* Text (``_get_qwen_prompt_embeds``): ``prompt_template_encode.format(prompt)`` (system turn
  "Describe the image by detailing ...", then the user turn), tokenized with ``padding=True``
  (longest), ``max_length=1024 + 34``, truncation; ``text_encoder(input_ids, attention_mask,
  output_hidden_states=True).hidden_states[-1]``; per prompt keep the unmasked tokens and drop the
  first ``prompt_template_encode_start_idx`` = 34 (the template up to ``"<|im_start|>user\\n"``;
  the closing ``"<|im_end|>\\n<|im_start|>assistant\\n"`` stays); right-pad with zeros to the
  longest prompt of the call; mask of ones/zeros. ``encode_prompt`` then cuts both to
  ``[:, :max_sequence_length]`` and sets the mask to ``None`` when it is all ones (e.g. one prompt).
  Text length varies per prompt: batching requests needs padding + ``encoder_hidden_states_mask``.
* Latents: ``randn_tensor((B, 1, in_channels // 4, 2*(H//16), 2*(W//16)), generator)`` then
  ``_pack_latents`` (same 2x2 packing as Flux; the same random numbers as a 4-D draw).
  ``img_shapes = [[(1, H // 16, W // 16)]] * B``.
* Timesteps: as Flux -- ``sigmas = np.linspace(1.0, 1 / N, N)``, ``mu = calculate_shift(
  image_seq_len, config["base_image_seq_len"], ["max_image_seq_len"], ["base_shift"],
  ["max_shift"])`` (defaults 256, 4096, 0.5, 1.15 if a key is missing; Qwen-Image's folder has
  256, 8192, 0.5, 0.9), ``retrieve_timesteps(sigmas=sigmas, mu=mu)``; the scheduler applies the
  exponential time shift, then ``stretch_shift_to_terminal`` (``shift_terminal=0.02``: the last
  sigma becomes 0.02), ``timesteps = sigmas * 1000``. ``set_begin_index(0)``.
* Denoiser: ``transformer(hidden_states=latents, timestep=t.expand(B) / 1000, guidance=None,
  encoder_hidden_states_mask=mask or None, encoder_hidden_states=embeds, img_shapes,
  attention_kwargs)`` (the time projection scales by 1000 inside).
* True CFG: ``do_true_cfg = true_cfg_scale > 1 and negative_prompt (or embeds) given``; separate
  call with the negative embeddings and mask (its own length); ``comb = neg + s * (cond - neg)``;
  ``noise = comb * (norm(cond, dim=-1, keepdim=True) / norm(comb, dim=-1, keepdim=True))``
  (per-token norm rescale).
* Decode: ``_unpack_latents`` -> (B, C, 1, h, w); ``latents / (1 / latents_std) + latents_mean``
  (``vae.config`` lists of ``z_dim`` values); ``vae.decode(...)[0][:, :, 0]``; ``postprocess``.

``QwenImageEditPipeline.__call__`` (``pipeline_qwenimage_edit.py``): same defaults, plus
------------------------------------------------------------------------------------------
* ``image`` is required in practice (its ``.size`` is read first). ``calculated_width, height =
  calculate_dimensions(1024 * 1024, w / h)`` (sqrt of the area times the ratio, rounded to
  multiples of 32); ``height``/``width`` default to those, floored to multiples of 16.
  The input image is ALWAYS resized to the calculated ~1 MP size, whatever the output size: for
  the VL encoder (the processor resizes again within its min/max pixels) and for the VAE.
* Text: template with ``<|vision_start|><|image_pad|><|vision_end|>`` before the prompt; the
  processor expands ``<|image_pad|>`` to ``grid_t * grid_h * grid_w / merge_size**2`` tokens and
  returns ``pixel_values``/``image_grid_thw`` for the encoder; ``drop_idx`` = 64 (the vision
  tokens are kept). The negative prompt is encoded with the same image.
* Image latents (``_encode_vae_image``): ``vae.encode(image (B, 3, 1, H', W')).latent_dist.mode()``
  (``sample_mode="argmax"``, no noise), ``(x - latents_mean) / latents_std``, packed.
  ``img_shapes = [[(1, H/16, W/16), (1, H'/16, W'/16)]] * B``. Per step
  ``hidden_states = cat([latents, image_latents], dim=1)``, prediction sliced to
  ``[:, :latents.size(1)]``; ``mu`` from the target token count only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from diffserve.pipelines.qwen_image_edit.adapter import Qwen2VLImageOnlyProcessor, load_qwen2vl_processor

from .components import qwen2_tokenizer

__all__ = ["Qwen2VLImageOnlyProcessor", "build_tiny_qwen_image", "build_tiny_qwen_image_edit", "load_qwen2vl_processor"]

#: ``scheduler/scheduler_config.json`` of Qwen/Qwen-Image (and Qwen-Image-Edit).
QWEN_IMAGE_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)

TEXT_HIDDEN_SIZE = 32


def _templates() -> list[tuple[str, int]]:
    """The (prompt template, dropped token count) pairs of both pipelines, read off the classes."""
    t2i = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    edit = QwenImageEditPipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    return [(p.prompt_template_encode, p.prompt_template_encode_start_idx) for p in (t2i, edit)]


def _qwen_components(seed: int) -> dict:
    tokenizer = qwen2_tokenizer(_templates())
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_HIDDEN_SIZE,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=TEXT_HIDDEN_SIZE,
            fullatt_block_indexes=[1],
            window_size=56,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels x 2x2 packing, as in Qwen-Image
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_HIDDEN_SIZE,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=2, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
    )


def build_tiny_qwen_image(out: Path, *, seed: int = 0) -> Path:
    """Build a tiny random-weight ``QwenImagePipeline`` and ``save_pretrained`` it to ``out``.

    Args:
        out: folder to write (created if missing).
        seed: ``torch.manual_seed`` for the random weights.

    Returns:
        ``out`` as a ``Path`` (~3 MB). Sizes must be multiples of 16 pixels; always pass
        ``height``/``width`` (the pipeline's default is 1024), and ``negative_prompt`` for true CFG.
    """
    pipe = QwenImagePipeline(**_qwen_components(seed))
    out = Path(out)
    pipe.save_pretrained(out)
    return out


def build_tiny_qwen_image_edit(out: Path, *, seed: int = 0) -> Path:
    """Build a tiny random-weight ``QwenImageEditPipeline`` and ``save_pretrained`` it to ``out``.

    The folder's ``model_index.json`` names ``["transformers", "Qwen2VLProcessor"]`` for
    ``processor`` as a real folder does; load it with
    ``QwenImageEditPipeline.from_pretrained(out, processor=load_qwen2vl_processor(out / "processor"))``
    when torchvision is not installed (see the module docstring).

    Returns:
        ``out`` as a ``Path`` (~3 MB). The input image is resized to ~1024x1024 by the pipeline
        whatever ``height``/``width`` are, so one call costs ~1 s on one CPU thread.
    """
    components = _qwen_components(seed)
    processor = Qwen2VLImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112),
        tokenizer=components["tokenizer"],
    )
    pipe = QwenImageEditPipeline(**components, processor=processor)
    out = Path(out)
    pipe.save_pretrained(out)
    _name_processor_class(out)
    return out


def _name_processor_class(out: Path) -> None:
    """Record the processor as ``Qwen2VLProcessor`` (the real folders' class) instead of the
    image-only subclass the folder was saved from."""
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_path = out / "processor" / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["processor_class"] = "Qwen2VLProcessor"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
