"""LoRA adapters per request: read every common file format into one per-module low-rank
representation (`reading`), keep adapters in a bounded pool of device slots (`pool`), and add
each row's own low-rank deltas inside one shared denoiser forward (`rows`).

Math (Hu et al. 2021, *LoRA*; per-row batching as in Punica, Chen et al. 2023, and S-LoRA,
Sheng et al. 2023): a module ``y = W x`` adapted by LoRA ``i`` at request weight ``w_i`` gives
``y = W x + sum_i w_i * s_i * B_i (A_i x)`` with ``s_i = lora_alpha / r`` (``/ sqrt(r)`` for
rsLoRA), exactly diffusers' ``set_adapters(names, weights)`` over PEFT layers. In a step batch the
base ``W x`` runs once for all rows; the rows that share a LoRA (and weight) get its two thin
matmuls together; rows without LoRA pay nothing more.

Components and module names come from the loaded diffusers pipeline and diffusers' own LoRA
loaders; the one exception is `sd3_kohya`, which converts SD3's kohya / ComfyUI files (Stability
AI's module names), a layout diffusers 0.42 reads for other families but not for SD3.
"""
