"""What the LoRA tests adapt in each family: the denoiser's target modules, the LoRA-loadable
text encoders, conv layers, and the non-diffusers layout diffusers converts for the family
(`tiny_models.loras`), by pipeline class name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tiny_models.loras import (
    random_lora,
    to_diffusion_model,
    to_kohya_flux,
    to_kohya_unet,
    to_musubi_wan,
    to_sai_sd3,
)

ATTN = ("to_q", "to_k", "to_v", "to_out.0")
CLIP = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
FLUX_TARGETS = ATTN + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_out", "ff.net.0.proj",
                       "ff.net.2", "ff_context.net.2")
#: SD3: both streams' attention and MLP, the adaLN linears (the pre-only context block's and the
#: final layer's are stored with scale and shift swapped in kohya files), embedders, output
SD3_TARGETS = ATTN + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.2", "ff_context.net.0.proj",
                      "norm1_context.linear", "norm_out.linear", "proj_out", "context_embedder",
                      "timestep_embedder.linear_1")
#: kohya Flux files fuse the single blocks' q/k/v/MLP-in as FLUX.1-sized slices (see to_kohya_flux)
FLUX_SKIP = (r"single_transformer_blocks\.\d+\.attn\.", r"^proj_out$")


@dataclass(frozen=True)
class Family:
    """LoRA test settings of one pipeline class.

    Attributes:
        denoiser: the component name (``transformer`` / ``unet``).
        targets: module-name suffixes the test adapters cover.
        text_encoders: LoRA-loadable text encoders the adapters also cover.
        conv: also adapt conv layers (kohya LoCon on UNets).
        layout: the non-diffusers layout tested (None: diffusers converts none for the family).
        skip: module-name patterns left out.
        tied: groups of module-name suffixes whose ``lora_A`` is the first one's (kohya's fused
            q/k/v LoRAs share one down projection).
    """

    denoiser: str
    targets: tuple[str, ...]
    text_encoders: tuple[str, ...] = ()
    conv: bool = False
    layout: str | None = None
    skip: tuple[str, ...] = ()
    tied: tuple[tuple[str, ...], ...] = ()

    def parts(self, pipe, seed: int, rank: int = 3, alpha: float = 6.0, text: bool = True) -> dict:
        """An adapter: component -> (PEFT state dict, rank, alpha)."""
        state_dict = random_lora(getattr(pipe, self.denoiser), self.targets, rank, seed, conv=self.conv, skip=self.skip)
        for first, *others in self.tied:
            for key in [k for k in state_dict if k.endswith(f".{first}.lora_A.weight")]:
                stem = key[: -len(f"{first}.lora_A.weight")]
                for other in others:
                    state_dict[f"{stem}{other}.lora_A.weight"] = state_dict[key].clone()
        parts = {self.denoiser: (state_dict, rank, alpha)}
        if text:
            for i, te in enumerate(self.text_encoders):
                parts[te] = (random_lora(getattr(pipe, te), CLIP, 2, seed + 10 + i), 2, 1.0)
        return parts

    def non_diffusers(self, pipe, parts: dict) -> dict[str, torch.Tensor]:
        """The same adapter in the family's non-diffusers layout."""
        if self.layout == "kohya" and self.denoiser == "unet":
            return to_kohya_unet(parts)
        if self.layout == "kohya":
            return to_kohya_flux(parts, len(pipe.transformer.transformer_blocks),
                                 len(pipe.transformer.single_transformer_blocks))
        if self.layout == "kohya_sd3":
            return to_sai_sd3(parts, len(pipe.transformer.transformer_blocks))
        if self.layout == "musubi":
            return to_musubi_wan(parts, len(pipe.transformer.blocks))
        return to_diffusion_model(parts)


FAMILIES: dict[str, Family] = {
    "StableDiffusion3Pipeline": Family("transformer", SD3_TARGETS, ("text_encoder", "text_encoder_2"),
                                       layout="kohya_sd3", tied=(("attn.to_q", "attn.to_k", "attn.to_v"),)),
    "FluxPipeline": Family("transformer", FLUX_TARGETS, ("text_encoder",), layout="kohya", skip=FLUX_SKIP),
    "FluxKontextPipeline": Family("transformer", FLUX_TARGETS, layout="kohya", skip=FLUX_SKIP),
    "StableDiffusionPipeline": Family("unet", ATTN + ("ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "conv1",
                                                      "conv2", "time_emb_proj"), ("text_encoder",), conv=True,
                                      layout="kohya"),
    "StableDiffusionXLPipeline": Family("unet", ATTN + ("ff.net.2",), ("text_encoder", "text_encoder_2"),
                                        layout="kohya"),
    "QwenImagePipeline": Family("transformer", ATTN + ("add_q_proj", "add_v_proj", "to_add_out"),
                                layout="diffusion_model"),
    "QwenImageEditPipeline": Family("transformer", ATTN, layout="diffusion_model"),
    "WanPipeline": Family("transformer", ATTN + ("ffn.net.0.proj", "ffn.net.2"), layout="musubi"),
}
