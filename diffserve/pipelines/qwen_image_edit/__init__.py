"""diffusers ``QwenImageEditPipeline``: the step adapter (`adapter`). Imported lazily through the registry."""
