"""diffusers ``QwenImagePipeline``: the adapter (`adapter`). Imported lazily through the registry."""
