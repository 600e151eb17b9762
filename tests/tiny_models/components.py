"""Tiny components shared by several families: offline tokenizers, text encoders, an 8x VAE.

Every object is a real transformers/diffusers class with a small config and random weights.
Tokenizers are built from in-memory vocabularies (nothing is downloaded):

* CLIP: the package's byte-level builder (:func:`diffserve.models.digits.tokenizer.build_clip_tokenizer`),
  256 byte symbols (+ ``</w>`` forms) and BOS/EOS, so any string tokenizes.
* T5 / UMT5: a character unigram vocabulary in T5's layout (pad=0, eos=1, unk=2).
* Qwen2: a byte-level BPE trained with ``train_new_from_iterator`` on the pipeline's own prompt
  templates, so every template word is one token (the Qwen-Image pipelines drop a fixed number of
  template tokens; :func:`qwen2_tokenizer` checks the count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from diffusers import AutoencoderKL
from diffserve.models.digits.tokenizer import build_clip_tokenizer
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

#: Special tokens of the Qwen2 / Qwen2.5-VL tokenizer that the Qwen-Image pipelines and the
#: Qwen2-VL processor look up by text (``<|endoftext|>`` is the pad/unk/eos token, id 0 here).
QWEN2_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A byte-level CLIP tokenizer (BOS id 0, EOS = pad = unk id 1), padded/truncated to
    ``model_max_length`` tokens by the pipelines (77 as in every real CLIP folder)."""
    return build_clip_tokenizer(model_max_length)


def t5_tokenizer() -> T5Tokenizer:
    """A character unigram T5 tokenizer (pad=0, eos=1, unk=2 as in T5 and UMT5)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-":
        pieces.append((c, -3.0))
        pieces.append(("▁" + c, -3.5))
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def qwen2_tokenizer(templates: Sequence[tuple[str, int]], vocab_size: int = 1024) -> Qwen2Tokenizer:
    """A byte-level Qwen2 BPE tokenizer trained offline on the pipelines' prompt templates.

    Args:
        templates: ``(template, drop_idx)`` pairs as the Qwen-Image pipelines hold them
            (``prompt_template_encode`` with one ``{}`` for the prompt, and
            ``prompt_template_encode_start_idx``).
        vocab_size: BPE vocabulary budget; the templates need ~480.

    Returns:
        A ``Qwen2Tokenizer`` whose special tokens are ``<|endoftext|>`` (id 0, pad/eos/unk) and
        :data:`QWEN2_SPECIAL_TOKENS` (ids 1..7, in that order).

    Raises:
        RuntimeError: if a template's text before ``{}`` does not tokenize into at least
            ``drop_idx`` tokens, or if its first ``drop_idx`` tokens do not end right after
            ``"<|im_start|>user\\n"`` as with the real Qwen2.5-VL tokenizer.
    """
    base = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[])
    tokenizer = base.train_new_from_iterator(
        [template for template, _ in templates], vocab_size=vocab_size, new_special_tokens=list(QWEN2_SPECIAL_TOKENS)
    )
    tokenizer.model_max_length = 131072  # Qwen2.5-VL's value
    user_turn = tokenizer("<|im_start|>user\n").input_ids
    for template, drop_idx in templates:
        ids = tokenizer(template.split("{}")[0]).input_ids
        if len(ids) < drop_idx or ids[drop_idx - len(user_turn) : drop_idx] != user_turn:
            raise RuntimeError(
                f"template prefix tokenizes to {len(ids)} tokens; the pipeline drops {drop_idx} and expects "
                "them to end with the user turn"
            )
    return tokenizer


def clip_text_config(
    tokenizer: CLIPTokenizer, *, hidden_size: int = 32, projection_dim: int = 32, num_hidden_layers: int = 2
) -> CLIPTextConfig:
    """A small CLIP text config matching ``tokenizer`` (vocab, max positions, BOS/EOS/pad ids).

    ``eos_token_id`` is the tokenizer's EOS, so the pooled output is read at the first EOS
    (as with the real CLIP tokenizers, whose EOS id differs from the legacy value 2).
    """
    return CLIPTextConfig(
        hidden_size=hidden_size,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=num_hidden_layers,
        projection_dim=projection_dim,
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="quick_gelu",
    )


def clip_text_model(tokenizer: CLIPTokenizer, *, hidden_size: int = 32) -> CLIPTextModel:
    """A tiny ``CLIPTextModel`` (CLIP-L's class: hidden states and ``pooler_output`` of width
    ``hidden_size``)."""
    return CLIPTextModel(clip_text_config(tokenizer, hidden_size=hidden_size))


def clip_text_model_with_projection(
    tokenizer: CLIPTokenizer, *, hidden_size: int = 32, projection_dim: int = 32
) -> CLIPTextModelWithProjection:
    """A tiny ``CLIPTextModelWithProjection`` (CLIP-G's class in SDXL: ``text_embeds`` of width
    ``projection_dim``)."""
    return CLIPTextModelWithProjection(
        clip_text_config(tokenizer, hidden_size=hidden_size, projection_dim=projection_dim)
    )


def _t5_config_kwargs(vocab_size: int, d_model: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        d_model=d_model,
        d_ff=37,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def t5_encoder(vocab_size: int, *, d_model: int = 32) -> T5EncoderModel:
    """A tiny ``T5EncoderModel`` (T5-v1.1-XXL's class in SD3/Flux) of width ``d_model``."""
    return T5EncoderModel(T5Config(**_t5_config_kwargs(vocab_size, d_model)))


def umt5_encoder(vocab_size: int, *, d_model: int = 32) -> UMT5EncoderModel:
    """A tiny ``UMT5EncoderModel`` (umt5-xxl's class in Wan) of width ``d_model``."""
    return UMT5EncoderModel(UMT5Config(**_t5_config_kwargs(vocab_size, d_model)))


def autoencoder_kl(
    *,
    latent_channels: int,
    scaling_factor: float,
    shift_factor: float | None = None,
    use_quant_conv: bool = True,
    force_upcast: bool = True,
    sample_size: int = 64,
    block_out_channels: Iterable[int] = (8, 8, 8, 8),
) -> AutoencoderKL:
    """A tiny ``AutoencoderKL`` with 4 levels, i.e. the real 8x spatial down-sampling.

    Args:
        latent_channels: 4 (SD 1.5, SDXL) or 16 (SD3, Flux).
        scaling_factor / shift_factor: copied from the real folder; the pipelines decode
            ``latents / scaling_factor (+ shift_factor)``.
        use_quant_conv: True for SD 1.5/SDXL, False for SD3/Flux (real layouts).
    """
    channels = tuple(block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=sample_size,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=use_quant_conv,
        use_post_quant_conv=use_quant_conv,
        force_upcast=force_upcast,
    )
