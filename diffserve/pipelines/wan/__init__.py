"""diffusers ``WanPipeline``: the adapter (`adapter`) and context folding of the padding rows (`context_folding`). Imported lazily through the registry."""
