"""All-gather of sequence shards of unequal length, on any torch.distributed backend.

Under Ulysses with an odd token count (e.g. a 48x48 Flux image: 9 tokens over 2 ranks) the
ranks hold shards of different lengths (diffusers' "Ulysses anything" split,
``tensor_split``: 5 and 4). diffusers gathers them at the plan's output with one
``dist.all_gather`` into buffers of each rank's size, which NCCL accepts but gloo refuses
(``ProcessGroupGloo::allgather: invalid tensor size``). `all_gather_uneven` pads every shard
to the longest one, gathers equal sizes, and crops each back (the attention all-to-alls already
take uneven split sizes on both backends); `UnevenGatherHook` is diffusers' output gather hook
using it, installed by `install_uneven_gather`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from diffusers.hooks.context_parallel import (
    _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE,
    ContextParallelGatherHook,
    _get_submodule_by_name,
)
from diffusers.models._modeling_parallel import ContextParallelOutput, gather_size_by_comm


def all_gather_uneven(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order.

    Args:
        tensor: this rank's shard, any dtype; all ranks' shards agree on every dimension but
            ``dim`` (e.g. (B, S_rank, D) image tokens with ``dim=1``).
        dim: the dimension the shards split.
        group: the ranks' process group (gloo or NCCL).

    Returns:
        (…, sum of S_rank, …): the whole tensor, on every rank. Shards are padded with zeros to
        the longest one for the collective and cropped back, so the result is exact.
    """
    sizes = gather_size_by_comm(tensor.shape[dim], group)
    longest = max(sizes)
    tensor = tensor.contiguous()
    if tensor.shape[dim] < longest:
        pad = list(tensor.shape)
        pad[dim] = longest - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(tensor) for _ in sizes]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim)


class UnevenGatherHook(ContextParallelGatherHook):
    """diffusers' `ContextParallelGatherHook` (0.42) gathering with `all_gather_uneven`."""

    def post_forward(self, module, output):
        is_tensor = isinstance(output, torch.Tensor)
        outputs = [output] if is_tensor else list(output)
        if len(outputs) != len(self.metadata):
            raise ValueError(f"Expected output to have {len(self.metadata)} elements, but got {len(outputs)}.")
        group = self.parallel_config._flattened_mesh.get_group()
        for i, spec in enumerate(self.metadata):
            if spec is not None:
                outputs[i] = all_gather_uneven(outputs[i], spec.gather_dim, group)
        return outputs[0] if is_tensor else tuple(outputs)


def install_uneven_gather(denoiser: torch.nn.Module, plan: dict) -> None:
    """Replace the output gather hooks that ``denoiser.enable_parallelism(cp_plan=plan)``
    registered with `UnevenGatherHook` (same name, same plan entry, same parallel config)."""
    for module_id, spec in plan.items():
        if not isinstance(spec, (ContextParallelOutput, list, tuple)):
            continue  # a split entry
        name = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
        modules = _get_submodule_by_name(denoiser, module_id)
        for module in modules if isinstance(modules, list) else [modules]:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            hook = registry.get_hook(name)
            registry.remove_hook(name, recurse=False)
            registry.register_hook(UnevenGatherHook(hook.metadata, hook.parallel_config), name)
