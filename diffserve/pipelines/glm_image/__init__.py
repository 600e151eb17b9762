"""The GLM-Image family (`GlmImagePipeline`, diffusers 0.42): an AR stage
(`GlmImageForConditionalGeneration` writes prior image tokens, `ar_stage`) and a step-batched
DiT stage (`GlmImageTransformer2DModel`, `adapter`)."""
