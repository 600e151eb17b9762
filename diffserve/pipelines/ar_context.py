"""The model math of an autoregressive (AR) stage whose product is a causal LM's context:
prompt formatting and the export of the LM's per-layer K/V.

A unified AR + diffusion model lets its DiT attend to what the LM computed over the prompt
and its own answer (BAGEL, Deng et al. 2025, arXiv:2505.14683: the generation tokens attend to
the LM's key/value cache). The AR stage runs the LM's generation (transformers' continuous
batching, or batched ``generate``); then `export_kv` runs ONE forward over each request's
whole sequence (prompt and generated tokens) and returns the keys and values of every layer,
as the AR stage hands them to the connector.

KV layout of one request (`export_kv`): float (L, num_layers, 2, H_kv, D): token position
first (so requests of different lengths pad along dim 0 / dim 1 in a batch), then the layer,
then key (0) / value (1), then KV head and head dim. Keys carry the LM's rotary position
embedding of positions 0..L-1, exactly as they sit in its KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def prompt_input_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids an LM is prompted with: its chat template with the generation prompt when the
    tokenizer has one (one user message), else plain ``tokenizer(prompt)`` with its special
    tokens.

    Returns:
        A list of ints (no padding).
    """
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
        ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    else:
        ids = tokenizer(prompt)["input_ids"]
    return [int(i) for i in ids]


def _layer_keys_values(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer of a transformers cache, each (B, H_kv, L, D)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]  # legacy tuple-of-tuples


@torch.inference_mode()
def export_kv(model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_token_id: int = 0) -> list[torch.Tensor]:
    """The per-layer keys and values of a causal LM over each sequence, from one batched forward.

    The sequences are right-padded to the longest and masked (positions 0..L_i - 1 of each are
    exactly its own forward; the padding is dropped), so each result equals the sequence's
    forward alone within float rounding.

    Args:
        model: a transformers causal LM (``model(input_ids, attention_mask, use_cache=True)``
            returns its cache).
        sequences: token ids of each request's whole context (prompt and generated tokens).
        pad_token_id: id used for the padding (never attended).

    Returns:
        One contiguous tensor per sequence, (L_i, num_layers, 2, H_kv, D), in the model dtype,
        on the model's device.

    Raises:
        ValueError: `sequences` is empty or holds an empty sequence.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("export_kv needs at least one non-empty sequence")
    device = next(model.parameters()).device
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    per_layer = _layer_keys_values(cache)
    # (B, layers, 2, H, L, D) -> (B, L, layers, 2, H, D)
    stacked = torch.stack([torch.stack([k, v], dim=1) for k, v in per_layer], dim=1).permute(0, 4, 1, 2, 3, 5)
    return [stacked[i, : len(s)].contiguous() for i, s in enumerate(sequences)]


__all__ = ["export_kv", "prompt_input_ids"]
