"""TeaCache forward split of FLUX.1 (`FluxTransformer2DModel`, also Kontext's): the denoiser's
forward in three parts around its repeated blocks, as `diffserve.acceleration.teacache` needs it
(`capabilities.TeaCacheSupport`).
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.pipelines import teacache_coefficients
from diffserve.pipelines.capabilities import TeaCacheSupport
from diffserve.pipelines.token_spans import zero_padded_spans


def _spans(context: dict[str, Any]):
    """The forward's ``spans`` (rows of different sizes) from the split's context, or None."""
    return (context["joint_attention_kwargs"] or {}).get("spans")


class FluxTeaCacheSplit:
    """`FluxTransformer2DModel.forward` (diffusers 0.42) in three parts around the blocks, for
    TeaCache; the modulated input is the first double block's ``norm1`` output, as in
    TeaCache4FLUX. Covers the text-to-image / Kontext path (no ControlNet, IP-Adapter).

    Tensors: hidden (rows, N_img, D) (reference-image tokens included for Kontext); context =
    dict(encoder (rows, N_txt, D), temb (rows, D), rotary (cos, sin) of (N_txt + N_img, head_dim),
    joint_attention_kwargs); output (rows, N_img, 4C). In a forward over rows of different sizes
    the modulated input is zero on each row's padded (noisy and reference) tokens
    (`flux.mixed_sizes`), so its relative change is the one its solo run measures.
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        """Returns (hidden, context, modulated input of the first double block)."""
        hidden = model.x_embedder(kwargs["hidden_states"])
        timestep = kwargs["timestep"].to(hidden.dtype) * 1000
        guidance = kwargs.get("guidance")
        if guidance is None:
            temb = model.time_text_embed(timestep, kwargs["pooled_projections"])
        else:
            temb = model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, kwargs["pooled_projections"])
        encoder = model.context_embedder(kwargs["encoder_hidden_states"])
        rotary = model.pos_embed(torch.cat((kwargs["txt_ids"], kwargs["img_ids"]), dim=0))
        context = {"encoder": encoder, "temb": temb, "rotary": rotary,
                   "joint_attention_kwargs": kwargs.get("joint_attention_kwargs")}
        # padded tokens add nothing to a row's relative change (as solo)
        modulated = zero_padded_spans(model.transformer_blocks[0].norm1(hidden, emb=temb)[0], _spans(context))
        return zero_padded_spans(hidden, _spans(context)), context, modulated

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index]}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Every double then single block; returns the image stream (rows, N_img, D)."""
        encoder = context["encoder"]
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=context["temb"],
                                    image_rotary_emb=context["rotary"],
                                    joint_attention_kwargs=context["joint_attention_kwargs"])
        return zero_padded_spans(hidden, _spans(context))

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """norm_out and proj_out: (rows, N_img, 4C)."""
        return zero_padded_spans(model.proj_out(model.norm_out(hidden, context["temb"])), _spans(context))


#: FLUX.1's TeaCache declaration (TeaCache4FLUX's coefficients; also used for Kontext).
TEACACHE = TeaCacheSupport(split=FluxTeaCacheSplit, coefficients=teacache_coefficients.FLUX_DEV,
                           rel_l1_thresh=0.4, source=teacache_coefficients.FLUX_DEV_SOURCE)
