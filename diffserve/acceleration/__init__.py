"""Acceleration: prompt-embedding cache, step-caching backends (TeaCache, cache-dit), regional
torch.compile and CUDA graphs, set up once per loaded model by `Accelerator`
(`accelerator.py`). The backends' options (`TeaCacheConfig`, `CacheDiTConfig`) are plain config
in `diffserve.config`, so the engine config validates them without importing torch."""
