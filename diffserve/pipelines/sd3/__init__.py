"""diffusers ``StableDiffusion3Pipeline``: the step adapter (`adapter`), its TeaCache forward split
(`teacache`), context folding of the zero placeholder rows (`context_folding`) and the Ulysses
context-parallel plan (`context_parallel`). Imported lazily through the registry."""
