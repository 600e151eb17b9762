"""Context folding for Wan's cross-attention: the zero padding rows of a prompt run as ONE row.

``WanPipeline`` pads every prompt's UMT5 states with zero rows up to ``max_sequence_length``
(512 by default) and passes no attention mask, so the transformer's cross-attention attends to
all 512 rows. The context path of a Wan text-to-video block is token-wise (the
``text_embedder`` MLP, the key/value projections, the RMS norm of the keys) and carries no
position, so all the zero rows give one identical key/value pair. Attention over ``k`` identical
keys with logit ``s`` equals attention over one of them with logit ``s + log k``: keeping the
first ``K`` rows and giving the LAST of them the bias ``+log(max_sequence_length - K + 1)``
computes the same function (within float rounding) on ``K`` rows instead of 512, as long as
the rows cut off were zero. A batch whose prompts have different lengths is right-padded with
zero rows to its longest ``K``: padding rows are zero rows too, so one bias on the last row is
exact for every row of the batch. With ``K == max_sequence_length`` the bias is ``log 1 = 0``:
the unfolded forward.

On the built-in video model (prompts of ~8 UMT5 tokens) the cross-attention keys shrink from
512 rows to ~9 per block; ``benchmarks/serving.py --no-context-folding`` measures the speed-up.
At fold count 1 (the default) the processor computes exactly diffusers' ``WanAttnProcessor``.

The count's ``max_sequence_length`` comes from the processor (``max_sequence_length``, set by
training code) or, when serving, from the forward context: each request's text length is its
row data (`FOLDED_CONTEXT_LENGTH`, equal within a batch: it is part of Wan's batch key), so a
processor outside diffserve's forwards computes stock diffusers.

Used by diffserve's Wan adapter (:mod:`diffserve.pipelines.wan.adapter`, when
``EngineConfig.context_folding`` is on) and to train the built-in video model
(``training.digits_video.train``); SD3's zero T5 rows are folded the same way
(:mod:`diffserve.pipelines.sd3.context_folding`). Only for text-to-video transformers (no image
context: Wan I2V's ``add_k_proj`` path slices the context by position).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffserve.pipelines.row_data import current_rows

#: ``RequestState.row_data`` key: the request's ``max_sequence_length``, the rows its folded
#: context stands for.
FOLDED_CONTEXT_LENGTH = "folded_context_length"


class FoldedCrossAttnProcessor(WanAttnProcessor):
    """Wan cross-attention processor for folded context: the LAST of the ``K`` context rows
    stands for ``max_sequence_length - K + 1`` identical rows (its attention logit gets
    ``+log`` of that count).

    Tensors as in diffusers' ``WanAttnProcessor``: hidden_states (B, N, D), encoder_hidden_states
    (B, K, D) with the folded row last; returns (B, N, D). The bias is added in the attention
    dtype (fp32: the folded forward matches the full one to ~1e-6). The count comes from the
    context's length, so a batch of any ``K`` runs with no per-batch state, and a compiled
    block sees ``K`` as a dynamic shape.

    Attributes:
        max_sequence_length: the number of rows the context stands for (the requests' padded
            UMT5 length, 512 by default); None = the forward context's `FOLDED_CONTEXT_LENGTH`
            (`diffserve.pipelines.row_data.current_rows`), and without one diffusers' stock
            computation (no fold).
    """

    def __init__(self, max_sequence_length: int | None = None):
        super().__init__()
        self.max_sequence_length = max_sequence_length

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        max_sequence_length = self.max_sequence_length
        if max_sequence_length is None:
            max_sequence_length = _forward_context_length()
        if max_sequence_length is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if encoder_hidden_states is None or attention_mask is not None or attn.add_k_proj is not None:
            raise ValueError("FoldedCrossAttnProcessor is for unmasked text-only cross-attention")
        # additive bias (1, 1, 1, K): log(rows each key stands for): 0 for all but the last key,
        # log(max_sequence_length - K + 1) for it; from tensor ops only, so K stays a dynamic shape
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)  # the log in at least fp32
        ones = torch.ones(1, 1, 1, encoder_hidden_states.shape[1], dtype=dtype, device=hidden_states.device)
        last = (max_sequence_length + 1) - ones.sum()
        counts = torch.cat([ones[..., :-1], last.view(1, 1, 1, 1)], dim=-1)
        return super().__call__(attn, hidden_states, encoder_hidden_states, counts.log().to(hidden_states.dtype),
                                rotary_emb)


@torch.compiler.disable  # eager: a compiled block guards on no row data (its memo changes per forward)
def _forward_context_length() -> int | None:
    """The forward context's `FOLDED_CONTEXT_LENGTH` (None outside diffserve's forwards)."""
    return current_rows().uniform(FOLDED_CONTEXT_LENGTH)


def supports_folding(transformer: torch.nn.Module) -> bool:
    """Whether `transformer` (a ``WanTransformer3DModel``) is text-to-video only: no image
    context (``image_dim`` / added key-value projections), so its context rows are position-free."""
    config = transformer.config
    return config.image_dim is None and config.added_kv_proj_dim is None


def install_folded_cross_attention(transformer: torch.nn.Module, max_sequence_length: int | None = None) -> None:
    """Give every block's cross-attention (``attn2``) a :class:`FoldedCrossAttnProcessor`.

    Raises:
        ValueError: the transformer has image context (see :func:`supports_folding`).
    """
    if not supports_folding(transformer):
        raise ValueError("context folding needs a text-to-video Wan transformer (no image context)")
    for block in transformer.blocks:
        block.attn2.set_processor(FoldedCrossAttnProcessor(max_sequence_length))


def set_max_sequence_length(transformer: torch.nn.Module, max_sequence_length: int | None) -> None:
    """Set the length the folded context stands for on every installed
    :class:`FoldedCrossAttnProcessor` (None: compute as stock diffusers, unfolded)."""
    if max_sequence_length is not None and max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    for block in transformer.blocks:
        block.attn2.processor.max_sequence_length = max_sequence_length


def uninstall_folded_cross_attention(transformer: torch.nn.Module) -> None:
    """Restore diffusers' stock ``WanAttnProcessor`` on every cross-attention."""
    for block in transformer.blocks:
        block.attn2.set_processor(WanAttnProcessor())


def fold_padding_rows(prompt_embeds: torch.Tensor) -> torch.Tensor:
    """Cut zero-padded prompt embeddings after their first all-zero trailing row.

    Args:
        prompt_embeds: (B, M, D) as ``WanPipeline.encode_prompt`` returns them: each row's
            token states, then zeros up to ``M = max_sequence_length``.

    Returns:
        (B, K, D), a new contiguous tensor: the rows up to the last nonzero one (over the
        batch), plus one zero row that stands for the rest (``K = M`` when nothing is padded).
        With :class:`FoldedCrossAttnProcessor` (``max_sequence_length = M``) the transformer
        computes what it does on the M rows: every row cut off is zero.
    """
    nonzero = prompt_embeds.ne(0).any(dim=2).any(dim=0).nonzero()
    rows = 1 if len(nonzero) == 0 else int(nonzero[-1]) + 2
    return prompt_embeds[:, : min(rows, prompt_embeds.shape[1])].contiguous()


def append_folded_row(prompt_embeds: torch.Tensor, max_sequence_length: int) -> torch.Tensor:
    """Append ONE zero row standing for the padding up to ``max_sequence_length`` rows (training:
    the text encoder runs only over the longest prompt's ``L`` tokens).

    Args:
        prompt_embeds: (B, L, D) prompt embeddings padded with zero rows to the longest prompt's
            length ``L`` (``WanPipeline.encode_prompt(..., max_sequence_length=L)``).
        max_sequence_length: the length the pipeline pads to at inference (512).

    Returns:
        (B, L + 1, D) whose last row is zero: it stands for ``max_sequence_length - L`` rows
        under :class:`FoldedCrossAttnProcessor` (``max_sequence_length``).

    Raises:
        ValueError: if ``L >= max_sequence_length`` (no padding left to fold).
    """
    length = prompt_embeds.shape[1]
    if length >= max_sequence_length:
        raise ValueError(f"{length} prompt rows leave no padding to fold (max_sequence_length {max_sequence_length})")
    zero = prompt_embeds.new_zeros(len(prompt_embeds), 1, prompt_embeds.shape[2])
    return torch.cat([prompt_embeds, zero], 1)
