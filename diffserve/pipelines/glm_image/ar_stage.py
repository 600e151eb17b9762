"""The AR stage of GLM-Image: `GlmImageForConditionalGeneration` writes the prior image tokens.

As diffusers' `GlmImagePipeline.generate_prior_tokens` for text-to-image: the processor's chat
template with the target size (``target_h`` / ``target_w``: a ``h/32 x w/32`` grid and a
preview grid), then ``generate`` samples ``h/32 * w/32 + preview + 1`` tokens; the large grid's
tokens, upsampled 2x (nearest), are the DiT's ``prior_token_id``. diffusers seeds the sampling
with ``torch.manual_seed(generator.initial_seed())``; here each request samples from its own
generator seeded with its seed (`diffserve.pipelines.ar_stage.PerRowSampler`), so requests of
one size share ONE batched ``generate`` and each gets diffusers' tokens for its seed.

The model keeps per-batch decode positions on itself (``_cached_decode_position_ids``): it is
driven by one batched ``generate`` at a time (no continuous batching).

Payload per request: ``"cond"``, kind ``"token_ids"``: ``tensors["prior_token_ids"]`` int64
(4 * h/32 * w/32,), ``meta`` ``{"token_h", "token_w"}`` (the large grid). The unconditional CFG
branch uses the same tokens with every prior embedding dropped, so it needs no payload of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import GlmImagePipeline

from diffserve.connector.payload import Payload
from diffserve.pipelines.ar_stage import ARInput, ARProduct, ARStageModel, generation_setup
from diffserve.core.sampling_params import SamplingParams


class GlmImageARStage(ARStageModel):
    """See the module docstring.

    Args:
        vision_language_encoder: the `GlmImageForConditionalGeneration`.
        processor: its `GlmImageProcessor`.
    """

    continuous_batching = False

    def __init__(self, vision_language_encoder: torch.nn.Module, processor: Any):
        self._model = vision_language_encoder
        self.processor = processor

    @property
    def language_model(self) -> torch.nn.Module:
        return self._model

    def max_context_tokens(self) -> int:
        return int(self._model.config.text_config.max_position_embeddings)

    def _chat(self, prompts: list[str], height: int, width: int) -> Any:
        messages = [[{"role": "user", "content": [{"type": "text", "text": p}]}] for p in prompts]
        return self.processor.apply_chat_template(
            messages, tokenize=True, return_dict=True,
            processor_kwargs={"padding": len(prompts) > 1, "target_h": height, "target_w": width, "return_tensors": "pt"})

    def inputs(self, request_id: str, prompt: str, params: SamplingParams) -> ARInput:
        encoded = self._chat([prompt], params.height, params.width)
        grids = encoded["image_grid_thw"]
        max_new, offset, token_h, token_w = GlmImagePipeline._compute_generation_params(grids, is_text_to_image=True)
        return ARInput(request_id, prompt, params, encoded["input_ids"][0].tolist(),
                       model_inputs={"offset": offset, "token_h": token_h, "token_w": token_w},
                       group=(params.height, params.width), max_new_tokens=max_new, seed=params.seed)

    def generate(self, batch: Sequence[ARInput]) -> list[list[int]]:
        """One batched ``generate`` (left padding, as the processor pads a batch) for requests of
        one size; each row sampled with its own seed."""
        first = batch[0]
        encoded = self._chat([r.prompt for r in batch], first.params.height, first.params.width)
        device = next(self._model.parameters()).device
        config, kwargs = generation_setup(self._model.generation_config, batch, first.max_new_tokens)
        out = self._model.generate(**{k: v.to(device) for k, v in encoded.items()}, generation_config=config,
                                   **kwargs)
        start = encoded["input_ids"].shape[-1]
        return [row.tolist() for row in out[:, start:]]

    def products(self, batch: Sequence[ARInput], generated: Sequence[list[int]]) -> list[ARProduct | BaseException]:
        out: list[ARProduct | BaseException] = []
        for r, tokens in zip(batch, generated):
            info = r.model_inputs
            n = info["token_h"] * info["token_w"]
            large = torch.tensor(tokens[info["offset"]: info["offset"] + n], dtype=torch.long)
            if large.numel() != n:
                out.append(RuntimeError(f"the AR model wrote {len(tokens)} tokens, fewer than the "
                                        f"{info['offset'] + n} the image needs"))
                continue
            prior = GlmImagePipeline._upsample_token_ids(large, info["token_h"], info["token_w"])[0]
            payload = Payload("token_ids", {"prior_token_ids": prior},
                              {"token_h": info["token_h"], "token_w": info["token_w"]})
            out.append(ARProduct({"cond": payload}, text=None, num_tokens=len(tokens)))
        return out


__all__ = ["GlmImageARStage"]
