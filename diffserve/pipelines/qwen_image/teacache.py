"""TeaCache forward split of Qwen-Image (`QwenImageTransformer2DModel`, also the edit model's): the
denoiser's forward in three parts around its repeated blocks, as
`diffserve.acceleration.teacache` needs it (`capabilities.TeaCacheSupport`).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

from diffserve.pipelines.capabilities import TeaCacheSupport
from diffserve.pipelines.token_spans import zero_padded_spans


def _spans(context: dict[str, Any]):
    """The forward's ``spans`` (rows of different sizes) from the split's context, or None."""
    return (context["attention_kwargs"] or {}).get("spans")


class QwenImageTeaCacheSplit:
    """`QwenImageTransformer2DModel.forward` (diffusers 0.42.1) in three parts around the blocks,
    for TeaCache; transformers without ``zero_cond_t`` / ``use_additional_t_cond`` and without
    ControlNet residuals.

    Tensors: hidden (rows, N_img, D); context = dict(encoder (rows, N_txt, D), mask (rows, N_txt)
    bool or None, temb (rows, D), rotary (image and text RoPE, shared by the rows),
    attention_kwargs); output (rows, N_img, patch**2 * C_out) packed. In a forward over rows of
    different sizes the modulated input is zero on each row's padded (noisy and reference) tokens
    (`qwen_image.mixed_sizes`), so its relative change is the one its solo run measures.
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        """Returns (hidden, context, modulated input of the first block's image stream)."""
        hidden = model.img_in(kwargs["hidden_states"])
        timestep = kwargs["timestep"].to(hidden.dtype)
        encoder = model.txt_in(model.txt_norm(kwargs["encoder_hidden_states"]))
        text_len, _, mask = compute_text_seq_len_from_mask(encoder, kwargs.get("encoder_hidden_states_mask"))
        temb = model.time_text_embed(timestep, hidden)
        rotary = model.pos_embed(kwargs["img_shapes"], max_txt_seq_len=text_len, device=hidden.device)
        first = model.transformer_blocks[0]
        img_mod1 = first.img_mod(temb).chunk(2, dim=-1)[0]
        context = {"encoder": encoder, "mask": mask, "temb": temb, "rotary": rotary,
                   "attention_kwargs": kwargs.get("attention_kwargs")}
        # padded tokens add nothing to a row's relative change (as solo)
        modulated = zero_padded_spans(first._modulate(first.img_norm1(hidden), img_mod1)[0], _spans(context))
        return zero_padded_spans(hidden, _spans(context)), context, modulated

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        mask = context["mask"]
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index],
                "mask": None if mask is None else mask[index]}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Every transformer block; returns the image stream (rows, N_img, D)."""
        encoder = context["encoder"]
        for block in model.transformer_blocks:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder,
                                    encoder_hidden_states_mask=context["mask"], temb=context["temb"],
                                    image_rotary_emb=context["rotary"],
                                    joint_attention_kwargs=context["attention_kwargs"])
        return zero_padded_spans(hidden, _spans(context))

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """norm_out and proj_out: (rows, N_img, patch**2 * C_out)."""
        return zero_padded_spans(model.proj_out(model.norm_out(hidden, context["temb"])), _spans(context))


#: Qwen-Image TeaCache rescaling coefficients as vLLM-Omni ships them for
#: QwenImageTransformer2DModel ("from ComfyUI-TeaCache"; vllm_omni/diffusion/cache/teacache/config.py).
QWEN_TEACACHE_COEFFICIENTS = (-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02)

#: Qwen-Image's TeaCache declaration (transformers with a plain time embedding only).
TEACACHE = TeaCacheSupport(split=QwenImageTeaCacheSplit, coefficients=QWEN_TEACACHE_COEFFICIENTS, rel_l1_thresh=0.2,
                           source="vLLM-Omni's QwenImageTransformer2DModel coefficients (from ComfyUI-TeaCache); "
                                  "0.2 ~1.5x per vLLM-Omni's TeaCache guide")
