"""The AR stage of `digits-reasoning`: its causal LM answers the prompt (continuous batching,
greedy), then its per-layer K/V go to the DiT.

Payloads per request (`diffserve.connector.payload.Payload`, kind ``"kv"``):

- ``"cond"``: the K/V of ``<bos> {prompt} = {answer} <eos>`` (the prompt through the chat
  template, then the generated tokens), ``tensors["kv"]`` (L, layers, 2, H_kv, D);
- ``"negative"`` (with CFG): the K/V of the negative prompt formatted the same way, not
  answered (``<bos> {negative_prompt} =``). Equal negative prompts give bit-identical K/V (each
  distinct one is computed alone once and kept in a small LRU), so the connector stores the
  default empty negative prompt's payload once for all requests.

``meta``: ``{"positions": [0, L], "num_layers", "num_kv_heads", "head_dim", "token_ids"}``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from diffserve.connector.payload import Payload
from diffserve.core.errors import InvalidRequestError
from diffserve.pipelines.ar_context import export_kv, prompt_input_ids
from diffserve.pipelines.ar_stage import ARInput, ARProduct, ARStageModel
from diffserve.core.sampling_params import SamplingParams

#: Negative-prompt contexts kept (distinct negative prompts).
_NEGATIVE_CACHE = 64


def uses_cfg(params: SamplingParams) -> bool:
    """Whether a request runs classifier-free guidance (a negative branch)."""
    return params.guidance_scale is not None and params.guidance_scale > 1.0


class DigitsReasoningARStage(ARStageModel):
    """See the module docstring.

    Args:
        language_model: the ``Qwen2ForCausalLM``.
        tokenizer: its tokenizer (chat template).
    """

    continuous_batching = True

    def __init__(self, language_model: torch.nn.Module, tokenizer: Any):
        self._lm = language_model
        self.tokenizer = tokenizer
        self.max_positions = int(language_model.config.max_position_embeddings)
        self._negatives: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    @property
    def language_model(self) -> torch.nn.Module:
        return self._lm

    def max_context_tokens(self) -> int:
        return self.max_positions

    def inputs(self, request_id: str, prompt: str, params: SamplingParams) -> ARInput:
        """The chat-formatted prompt ids, greedy, the LM's own ``max_new_tokens``.

        Raises:
            InvalidRequestError: the prompt (or negative prompt) and the answer do not fit the
                LM's context of ``max_position_embeddings`` tokens.
        """
        max_new = int(self._lm.generation_config.max_new_tokens or 4)
        ids = prompt_input_ids(self.tokenizer, prompt)
        room = self.max_positions - max_new
        if len(ids) > room:
            raise InvalidRequestError("prompt", prompt, f"at most {room} tokens for this language model "
                                      f"(its context holds {self.max_positions}, {max_new} kept for the answer)",
                                      f"{len(ids)} tokens")
        negative = None
        if uses_cfg(params):
            negative = prompt_input_ids(self.tokenizer, params.negative_prompt or "")
            if len(negative) > self.max_positions:
                raise InvalidRequestError("negative_prompt", params.negative_prompt,
                                          f"at most {self.max_positions} tokens for this language model")
        return ARInput(request_id, prompt, params, ids, {"negative_ids": negative}, group=None,
                       max_new_tokens=max_new, seed=None)

    def _payload(self, kv: torch.Tensor, token_ids: list[int]) -> Payload:
        length, layers, _, heads, head_dim = kv.shape
        return Payload("kv", {"kv": kv}, {"positions": [0, length], "num_layers": layers, "num_kv_heads": heads,
                                          "head_dim": head_dim, "token_ids": token_ids})

    def _negative(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        kv = self._negatives.get(key)
        if kv is None:
            [kv] = export_kv(self._lm, [ids], self.tokenizer.pad_token_id)
            self._negatives[key] = kv
            while len(self._negatives) > _NEGATIVE_CACHE:
                self._negatives.popitem(last=False)
        else:
            self._negatives.move_to_end(key)
        return kv

    def text(self, generated: list[int]) -> str:
        """The answer: the generated tokens decoded without special tokens, stripped."""
        return self.tokenizer.decode(generated, skip_special_tokens=True).strip()

    def products(self, batch: Sequence[ARInput], generated: Sequence[list[int]]) -> list[ARProduct | BaseException]:
        """One batched K/V export of every request's prompt and answer; negative branches from
        the LRU (see the module docstring)."""
        sequences = [r.prompt_ids + list(g) for r, g in zip(batch, generated)]
        contexts = export_kv(self._lm, sequences, self.tokenizer.pad_token_id)
        out: list[ARProduct | BaseException] = []
        for r, g, seq, kv in zip(batch, generated, sequences, contexts):
            parts = {"cond": self._payload(kv, seq)}
            negative_ids = (r.model_inputs or {}).get("negative_ids")
            if negative_ids is not None:
                parts = {"negative": self._payload(self._negative(negative_ids), negative_ids), **parts}
            out.append(ARProduct(parts, text=self.text(list(g)), num_tokens=len(g)))
        return out


__all__ = ["DigitsReasoningARStage", "uses_cfg"]
