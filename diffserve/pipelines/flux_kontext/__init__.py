"""diffusers ``FluxKontextPipeline``: the adapter (`adapter`). Imported lazily through the registry."""
