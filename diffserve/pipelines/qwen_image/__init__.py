"""diffusers ``QwenImagePipeline``: the step adapter (`adapter`) and its TeaCache forward split
(`teacache`). Imported lazily through the registry."""
