"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509) for
the denoiser of a step batch, built on diffusers' context-parallel hooks.

The ranks of a Ulysses group each hold 1/P of the token sequence through the transformer
blocks; inside attention an all-to-all trades the sequence split for a head split (every rank
attends over the full sequence with H/P heads), and a second all-to-all trades it back; the
output head gathers the sequence (as in xDiT / yunchang). diffusers implements this for models
that declare a context-parallel plan (``_cp_plan``: where to split and gather) and route
attention through ``dispatch_attention_fn`` (Flux, Qwen-Image, Wan); an adapter supplies the
plan and processors for families without one (SD3, `diffserve.pipelines.sd3.context_parallel`).
Arbitrary sequence lengths and head counts are allowed (diffusers' "Ulysses anything" mode);
the output gather of shards of unequal length (odd token counts) is `uneven_gather`'s, which
gloo accepts too.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from diffserve.core.errors import InvalidRequestError
from diffserve.parallel.uneven_gather import install_uneven_gather

if TYPE_CHECKING:
    from diffserve.parallel.state import ParallelState
    from diffserve.pipelines.base import PipelineAdapter


@contextmanager
def _cpu_device_count():
    """diffusers picks the rank's device as ``rank % torch.accelerator.device_count()``, which is
    0 on a CPU-only machine; report one (the CPU) while the config is resolved."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def enable_ulysses(adapter: "PipelineAdapter", state: "ParallelState") -> None:
    """Split the adapter's denoiser over ``state``'s Ulysses group (requests of different sizes
    then batch apart: `PipelineAdapter.mixed_sizes` off).

    Raises:
        InvalidRequestError: the family has no sequence-parallel plan.
    """
    from diffusers import ContextParallelConfig

    denoiser = adapter.denoiser
    adapter.mixed_sizes = False  # the plans shard the sequence without token spans: batch by size
    prepare = adapter.capabilities.context_parallel
    plan = prepare(denoiser) if prepare is not None else getattr(denoiser, "_cp_plan", None)
    if plan is None:
        raise InvalidRequestError("ulysses_degree", state.ulysses_degree,
                                  f"1: {adapter.pipeline_class_name} has no sequence-parallel plan")
    config = ContextParallelConfig(ulysses_degree=state.ulysses_degree, mesh=state.mesh["ring", "ulysses"],
                                   ulysses_anything=True)
    with _cpu_device_count():
        denoiser.enable_parallelism(config=config, cp_plan=plan)
    install_uneven_gather(denoiser, plan)
