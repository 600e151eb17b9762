"""diffserve's seed rule for several images per prompt in the terms diffusers' pipelines take,
for reference runs: image i of a request with seed s is drawn from seed s + i
(`diffserve.core.sampling_params.image_seed`), i.e. diffusers with one generator per image."""

from __future__ import annotations

import numpy as np
import torch

from diffserve.core.sampling_params import image_seed


def image_generators(seed: int, n: int = 1) -> torch.Generator | list[torch.Generator]:
    """diffusers' ``generator=`` for `n` images of a request with `seed`: one CPU generator
    for one image, else one per image (seed + i)."""
    generators = [torch.Generator("cpu").manual_seed(image_seed(seed, i)) for i in range(n)]
    return generators[0] if n == 1 else generators


def per_image(call, seed: int, n: int) -> np.ndarray:
    """`call(generator)` (a one-image diffusers run returning (1, ...) images) for each of the
    `n` images' seeds, stacked: the reference where diffusers' own list-of-generators rule
    differs from one-image runs (img2img encodes the input once and repeats it)."""
    return np.concatenate([call(torch.Generator("cpu").manual_seed(image_seed(seed, i))) for i in range(n)])
