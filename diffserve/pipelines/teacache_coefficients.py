"""Published TeaCache rescaling coefficients (Liu et al. 2024, arXiv:2411.19108), shared by the
adapters that use them.

Each polynomial (``numpy.poly1d`` order, highest degree first) maps the relative L1 change of a
model's modulated input between two steps to the estimated change of its output; the adapters
pass them to `diffserve.acceleration.teacache` through `TeaCacheSupport`. A model folder's
calibration (``diffserve_cache.json``, written by ``diffserve calibrate-cache --model DIR``)
or ``generation_config.json`` ``teacache`` entry overrides them.
"""

from __future__ import annotations

#: FLUX.1-dev, fitted by the TeaCache authors (github.com/ali-vilab/TeaCache,
#: ``TeaCache4FLUX/teacache_flux.py``). Also used for FLUX.1-schnell / Kontext folders and, as in
#: SD3 ports of TeaCache (e.g. PaddleMIX's), for SD3: no calibration was published for those.
FLUX_DEV = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)

#: Speed/threshold pairs the TeaCache README reports for FLUX.1-dev (28-50 steps).
FLUX_DEV_SOURCE = ("TeaCache4FLUX coefficients (FLUX.1-dev, github.com/ali-vilab/TeaCache); "
                   "rel_l1_thresh 0.25 ~1.5x, 0.4 ~1.8x, 0.6 ~2.0x on FLUX.1-dev per the TeaCache README")
