"""diffusers ``FluxPipeline``: the adapter (`adapter`). Imported lazily through the registry."""
