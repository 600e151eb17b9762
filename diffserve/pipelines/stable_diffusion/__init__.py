"""diffusers ``StableDiffusionPipeline``: the adapter (`adapter`). Imported lazily through the registry."""
