"""`DigitsReasoningPipeline`: the diffusers-style reference pipeline of the built-in
``digits-reasoning`` model (an AR stage feeding a DiT through the LM's K/V).

Two stages, one after the other, as a diffusers pipeline runs them:

1. **AR stage**: the causal LM (``language_model``, a transformers ``Qwen2ForCausalLM``) answers
   the prompt greedily with its own ``generation_config`` (the tokenizer's chat template:
   ``<bos> {prompt} =``, then e.g. ``seven <eos>``); `diffserve.pipelines.ar_context.export_kv`
   returns its per-layer K/V over the prompt and the answer. With classifier-free guidance the
   negative prompt (default ``""``) is formatted the same way but not answered: its branch
   reads the K/V of ``<bos> {negative_prompt} =`` only.
2. **DiT stage**: an `SD3Transformer2DModel` (the built-in digits architecture) whose attention
   reads the LM's K/V (`ar_context_attention`) denoises 8x8 latents with flow-matching Euler
   steps and CFG; the digits `AutoencoderKL` decodes them.

The DiT's own text stream is a single constant token (zero ``encoder_hidden_states`` and
``pooled_projections``): everything it knows about the prompt comes through the K/V.

``DigitsReasoningPipeline.from_pretrained(folder)`` loads the shipped folder with no diffserve
serving code; diffserve serves the same math with the AR stage and the DiT stage running
concurrently (`diffserve.pipelines.digits_reasoning.adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

from diffserve.pipelines.ar_context import export_kv, prompt_input_ids
from diffserve.pipelines.digits_reasoning.ar_context_attention import install_ar_context_attention


@dataclass
class DigitsReasoningPipelineOutput(BaseOutput):
    """Images and the AR stage's answers.

    Attributes:
        images: PIL images, or a float (N, H, W, C) array in [0, 1] (``output_type="np"``).
        ar_texts: the language model's answer for each prompt (e.g. ``"seven"``).
    """

    images: list[PIL.Image.Image] | np.ndarray
    ar_texts: list[str]


def pad_contexts(contexts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad per-row LM contexts (L_i, ...) along dim 0 into one (rows, L, ...) tensor.

    Returns:
        ``(ar_kv, ar_kv_mask)``: the padded batch and its (rows, L) bool mask of real tokens,
        or None when every context has the same length (no mask needed).
    """
    longest = max(c.shape[0] for c in contexts)
    if all(c.shape[0] == longest for c in contexts):
        return torch.stack(contexts), None
    padded = contexts[0].new_zeros((len(contexts), longest) + tuple(contexts[0].shape[1:]))
    mask = torch.zeros((len(contexts), longest), dtype=torch.bool, device=contexts[0].device)
    for i, c in enumerate(contexts):
        padded[i, : c.shape[0]] = c
        mask[i, : c.shape[0]] = True
    return padded, mask


class DigitsReasoningPipeline(DiffusionPipeline):
    """Reference pipeline (see the module docstring).

    Args:
        language_model: transformers causal LM whose KV heads x head dim and layer count equal
            the transformer's heads x head dim and block count.
        tokenizer: its tokenizer (with the chat template).
        transformer: `SD3Transformer2DModel`; its attention processors are replaced by
            `ARContextJointAttnProcessor` s.
        vae: `AutoencoderKL` (1 channel, ``vae_scale_factor`` 1).
        scheduler: `FlowMatchEulerDiscreteScheduler`.
    """

    model_cpu_offload_seq = "language_model->transformer->vae"

    def __init__(self, language_model: Any, tokenizer: Any, transformer: SD3Transformer2DModel,
                 vae: AutoencoderKL, scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(language_model=language_model, tokenizer=tokenizer, transformer=transformer, vae=vae,
                              scheduler=scheduler)
        install_ar_context_attention(transformer)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

    # ------------------------------------------------------------------ AR stage
    @torch.inference_mode()
    def generate_answers(self, prompts: list[str], max_new_tokens: int | None = None) -> tuple[list[str], list[list[int]]]:
        """The LM's greedy answers, one batched ``generate`` (left-padded prompts).

        Returns:
            ``(answer texts, whole sequences)``: the decoded answers (special tokens dropped)
            and each prompt's ids followed by its generated ids (up to and including EOS).
        """
        lm, tok = self.language_model, self.tokenizer
        prompt_ids = [prompt_input_ids(tok, p) for p in prompts]
        longest = max(len(p) for p in prompt_ids)
        pad = tok.pad_token_id
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_ids])
        kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        out = lm.generate(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device), do_sample=False,
                          pad_token_id=pad, **kwargs)
        eos = lm.generation_config.eos_token_id
        texts, sequences = [], []
        for p, row in zip(prompt_ids, out[:, longest:].tolist()):
            generated = []
            for t in row:
                generated.append(t)
                if t == eos:
                    break
            texts.append(tok.decode(generated, skip_special_tokens=True).strip())
            sequences.append(p + generated)
        return texts, sequences

    def negative_context_ids(self, negative_prompt: str) -> list[int]:
        """Token ids of a guidance branch: the negative prompt formatted like a prompt, not answered."""
        return prompt_input_ids(self.tokenizer, negative_prompt)

    # ------------------------------------------------------------------ DiT stage
    def constant_context(self, rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The DiT's text inputs: one zero context token and zero pooled projections per row."""
        config = self.transformer.config
        return {"encoder_hidden_states": torch.zeros(rows, 1, config.joint_attention_dim, dtype=dtype,
                                                     device=self.device),
                "pooled_projections": torch.zeros(rows, config.pooled_projection_dim, dtype=dtype, device=self.device)}

    @torch.inference_mode()
    def __call__(self, prompt: str | list[str], negative_prompt: str | None = None, num_inference_steps: int = 20,
                 guidance_scale: float = 4.0, height: int = 8, width: int = 8,
                 generator: torch.Generator | list[torch.Generator] | None = None, latents: torch.Tensor | None = None,
                 output_type: str = "pil", return_dict: bool = True,
                 ar_kv: list[torch.Tensor] | None = None) -> DigitsReasoningPipelineOutput | tuple:
        """Answer each prompt with the LM, then draw each answer.

        Args:
            prompt: one prompt or a list (one image each).
            negative_prompt: the unconditional branch's text with CFG (default ``""``).
            guidance_scale: CFG weight; > 1 runs the negative branch.
            generator: one generator, or one per prompt (diffusers' convention).
            ar_kv: replace the LM's K/V of each prompt (a (L, layers, 2, H, D) tensor each);
                used to check that the DiT reads them (the answers are still generated).

        Returns:
            `DigitsReasoningPipelineOutput` (or ``(images, ar_texts)``).
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        texts, sequences = self.generate_answers(prompts)
        contexts = ar_kv if ar_kv is not None else export_kv(self.language_model, sequences,
                                                             self.tokenizer.pad_token_id)
        cfg = guidance_scale > 1
        if cfg:
            [negative] = export_kv(self.language_model, [self.negative_context_ids(negative_prompt or "")],
                                   self.tokenizer.pad_token_id)
            contexts = [negative] * len(prompts) + list(contexts)
        ar_kv_batch, ar_kv_mask = pad_contexts([c.to(self.device) for c in contexts])
        dtype = self.transformer.dtype
        rows = len(contexts)
        shape = (len(prompts), self.transformer.config.in_channels, height // self.vae_scale_factor,
                 width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype) if latents is None \
            else latents.to(self.device, dtype)
        timesteps, _ = retrieve_timesteps(self.scheduler, num_inference_steps, self.device)
        kwargs = {"joint_attention_kwargs": {"ar_kv": ar_kv_batch, "ar_kv_mask": ar_kv_mask},
                  **self.constant_context(rows, dtype)}
        for t in timesteps:
            x = torch.cat([latents] * 2) if cfg else latents
            out = self.transformer(hidden_states=x, timestep=t.expand(rows), return_dict=False, **kwargs)[0]
            if cfg:
                uncond, cond = out.chunk(2)
                out = uncond + guidance_scale * (cond - uncond)
            latents = self.scheduler.step(out, t, latents, return_dict=False)[0]
        if output_type == "latent":
            images = latents
        else:
            vae = self.vae
            decoded = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
            images = self.image_processor.postprocess(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, texts
        return DigitsReasoningPipelineOutput(images=images, ar_texts=texts)


__all__ = ["DigitsReasoningPipeline", "DigitsReasoningPipelineOutput", "pad_contexts"]
