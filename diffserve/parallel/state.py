"""`ParallelState`: this worker's place in the CFG x Ulysses process grid.

Ranks are laid out ``rank = cfg_rank * ulysses_degree + ulysses_rank``: the ranks of one
Ulysses group (same ``cfg_rank``) split the token sequence of one denoiser forward; the ranks
of one CFG group (same ``ulysses_rank``) split the forward's rows (the guidance branches).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """Process-grid facts of one worker.

    Attributes:
        rank / world_size: global rank and size (cfg_parallel_size x ulysses_degree).
        cfg_parallel_size / ulysses_degree: the grid's two dimensions.
        cfg_group / ulysses_group: torch.distributed groups of this rank (None when size 1).
        mesh: the (cfg, ring, ulysses) DeviceMesh (None when world_size == 1).
    """

    rank: int = 0
    world_size: int = 1
    cfg_parallel_size: int = 1
    ulysses_degree: int = 1
    cfg_group: Any = None
    ulysses_group: Any = None
    mesh: Any = field(default=None, repr=False)

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.ulysses_degree

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    @property
    def is_driver(self) -> bool:
        """Rank 0 decodes and reports results."""
        return self.rank == 0


def init_parallel(rank: int, cfg_parallel_size: int, ulysses_degree: int, master_port: int,
                  device: torch.device) -> ParallelState:
    """Join the process group (gloo on CPU, NCCL on CUDA) and build the grid.

    Args:
        master_port: TCP port of rank 0's rendezvous on 127.0.0.1.
    """
    world = cfg_parallel_size * ulysses_degree
    state = ParallelState(rank=rank, world_size=world, cfg_parallel_size=cfg_parallel_size,
                          ulysses_degree=ulysses_degree)
    if world == 1:
        return state
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    state.mesh = init_device_mesh(device.type, (cfg_parallel_size, 1, ulysses_degree),
                                  mesh_dim_names=("cfg", "ring", "ulysses"))
    if cfg_parallel_size > 1:
        state.cfg_group = state.mesh["cfg"].get_group()
    if ulysses_degree > 1:
        state.ulysses_group = state.mesh["ulysses"].get_group()
    return state


def shutdown_parallel(state: ParallelState) -> None:
    """Leave the process group (idempotent)."""
    if state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
