"""diffusers ``StableDiffusionXLPipeline``: the adapter (`adapter`). Imported lazily through the registry."""
