"""TeaCache forward split of SD3 (`SD3Transformer2DModel`): the denoiser's forward in three parts
around its repeated blocks, as `diffserve.acceleration.teacache` needs it
(`capabilities.TeaCacheSupport`).
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.pipelines import teacache_coefficients
from diffserve.pipelines.capabilities import TeaCacheSupport
from diffserve.pipelines.token_spans import zero_padded_tokens


class SD3TeaCacheSplit:
    """`SD3Transformer2DModel.forward` (diffusers 0.42) in three parts around the blocks, for
    TeaCache. Covers the text-to-image path (no ControlNet, IP-Adapter, skip_layers).

    Tensors: hidden (rows, N_img, D); context = dict(encoder (rows, N_txt, D), temb (rows, D),
    height, width in latent pixels, joint_attention_kwargs); output (rows, C, height, width).
    In a forward over rows of different sizes (`sd3.mixed_sizes`: rows padded in a strip of
    ``N_img`` patches) the embedded input, the modulated input, the blocks' output and the
    output are zero on each row's padded patches, so the relative changes and errors TeaCache
    and its guard take of a row (means over the tensor) are the ones its solo run measures;
    nobody reads those patches otherwise (masked keys, `TokenLayout.from_strip`).
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        """Returns (hidden, context, modulated input of the first block)."""
        x = kwargs["hidden_states"]
        hidden = model.pos_embed(x).contiguous()
        hidden = zero_padded_tokens(hidden, hidden.shape[1])
        temb = model.time_text_embed(kwargs["timestep"], kwargs["pooled_projections"])
        encoder = model.context_embedder(kwargs["encoder_hidden_states"])
        modulated = zero_padded_tokens(model.transformer_blocks[0].norm1(hidden, emb=temb)[0], hidden.shape[1])
        context = {"encoder": encoder, "temb": temb, "height": x.shape[-2], "width": x.shape[-1],
                   "joint_attention_kwargs": kwargs.get("joint_attention_kwargs")}
        return hidden, context, modulated

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index]}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Every transformer block; returns the image stream (rows, N_img, D)."""
        encoder, temb = context["encoder"], context["temb"]
        for block in model.transformer_blocks:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                    joint_attention_kwargs=context["joint_attention_kwargs"])
        return zero_padded_tokens(hidden, hidden.shape[1])

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """norm_out, proj_out and unpatchify to (rows, C, height, width)."""
        hidden = zero_padded_tokens(model.proj_out(model.norm_out(hidden, context["temb"])), hidden.shape[1])
        p = model.config.patch_size
        h, w = context["height"] // p, context["width"] // p
        hidden = hidden.reshape(hidden.shape[0], h, w, p, p, model.out_channels)
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(hidden.shape[0], model.out_channels, h * p, w * p)


#: SD3's TeaCache declaration: no calibration was published for SD3; its TeaCache ports reuse
#: FLUX.1-dev's coefficients.
TEACACHE = TeaCacheSupport(split=SD3TeaCacheSplit, coefficients=teacache_coefficients.FLUX_DEV, rel_l1_thresh=0.4,
                           source="TeaCache4FLUX coefficients (FLUX.1-dev), as reused by SD3 TeaCache ports; "
                                  "0.25 ~1.5x, 0.4 ~1.8x on FLUX per the TeaCache README")
