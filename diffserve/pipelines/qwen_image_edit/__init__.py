"""diffusers ``QwenImageEditPipeline``: the adapter (`adapter`). Imported lazily through the registry."""
