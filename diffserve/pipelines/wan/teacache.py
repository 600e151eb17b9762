"""TeaCache forward split of Wan (`WanTransformer3DModel`, text-to-video): the denoiser's forward
in three parts around its repeated blocks, as `diffserve.acceleration.teacache` needs it
(`capabilities.TeaCacheSupport`).
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.pipelines.capabilities import TeaCacheSupport
from diffserve.pipelines.row_data import current_rows
from diffserve.pipelines.wan.mixed_sizes import select_rotary, zero_outside


def _real_tokens(hidden: torch.Tensor, rotary: tuple) -> torch.Tensor:
    """`hidden` (rows, N, D) zero on each row's padded tokens in a forward of padded rows (the
    rotary tuple then carries the (rows, 1, 1, N) key mask, `wan.mixed_sizes`), else `hidden`:
    the blocks' residual a level forecasts (``target="residual"``) and the means its guard takes
    are then the row's solo run's. Padded tokens are masked keys, so no real token reads them."""
    return hidden if len(rotary) < 3 else hidden.masked_fill(~rotary[2][:, 0, 0, :, None], 0)


class WanTeaCacheSplit:
    """`WanTransformer3DModel.forward` (diffusers 0.42) in three parts around the blocks, for
    TeaCache; text-to-video with one timestep per row (no image embeddings, no per-token
    timesteps).

    Tensors: hidden (rows, N_patches, D); context = dict(encoder (rows, L, D), temb (rows, D),
    proj (rows, 6, D), rotary (cos, sin), each (1, N_patches, 1, head_dim), plus in a forward
    of padded rows their (rows, 1, 1, N_patches) key mask (`wan.mixed_sizes`), shape of the
    latent input (rows, C, F, h, w)); modulated = temb (TeaCache4Wan2.1's ``e``); output
    (rows, C_out, F, h, w). In a forward of padded rows the embedded input, the blocks' output
    and the output are zero outside each row's own tokens (`_real_tokens`, `zero_outside`).
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        x = kwargs["hidden_states"]
        rotary = model.rope(x)
        hidden = model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
        temb, proj, encoder, _ = model.condition_embedder(kwargs["timestep"], kwargs["encoder_hidden_states"])
        context = {"encoder": encoder, "temb": temb, "proj": proj.unflatten(1, (6, -1)), "rotary": rotary,
                   "shape": tuple(x.shape)}
        return _real_tokens(hidden, rotary), context, temb

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index],
                "proj": context["proj"][index], "rotary": select_rotary(context["rotary"], index)}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        for block in model.blocks:
            hidden = block(hidden, context["encoder"], context["proj"], context["rotary"])
        return _real_tokens(hidden, context["rotary"])

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Output norm, projection and unpatchify to (rows, C_out, F, h, w)."""
        temb = context["temb"]
        shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = model.proj_out(hidden)
        _, _, f, h, w = context["shape"]
        p_t, p_h, p_w = model.config.patch_size
        hidden = hidden.reshape(hidden.shape[0], f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        # zero outside each row's own grid in a mixed forward: the guard's means of a row's
        # output and forecasts are then its solo run's (nobody reads those latents otherwise)
        return zero_outside(hidden, current_rows())


#: TeaCache4Wan2.1 (github.com/ali-vilab/TeaCache, TeaCache4Wan2.1/teacache_generate.py, T2V,
#: modulated input = the time embedding ``e``, first and last step computed): rescaling
#: coefficients and the threshold of its README's ~2x row, by transformer width.
WAN21_TEACACHE = {
    1536: ((2.39676752e03, -1.31110545e03, 2.01331979e02, -8.29855975e00, 1.37887774e-01), 0.08, "1.3B"),
    5120: ((-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404), 0.2, "14B"),
}


def teacache_support(transformer: torch.nn.Module) -> TeaCacheSupport:
    """Wan 2.1's TeaCache declaration for `transformer`: the TeaCache4Wan2.1 coefficients of its
    width (the 1.3B model's for an uncalibrated width)."""
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    coefficients, thresh, size = WAN21_TEACACHE.get(width, WAN21_TEACACHE[1536])
    source = (f"TeaCache4Wan2.1 T2V-{size} coefficients (github.com/ali-vilab/TeaCache)"
              + ("" if width in WAN21_TEACACHE else f"; no calibration for width {width}, the 1.3B one"))
    return TeaCacheSupport(split=WanTeaCacheSplit, coefficients=coefficients, rel_l1_thresh=thresh, source=source)
