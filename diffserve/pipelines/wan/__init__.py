"""diffusers ``WanPipeline``: the step adapter (`adapter`), its TeaCache forward split
(`teacache`) and context folding of the padding rows (`context_folding`). Imported lazily
through the registry."""
