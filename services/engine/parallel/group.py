"""A tensor-parallel group as a model's layers see it: this process's rank, the group's size,
and the collectives a sharded layer needs, on torch.distributed (gloo on CPU, NCCL on CUDA).

A group of one is the default everywhere: its collectives return at once, so the single-rank
model runs exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank that stops answering takes its group down within this (no collective hangs forever).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the row-parallel linears' partial outputs)."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, cols] per rank -> [rows, size * cols], rank 0's columns first (the
        vocab-parallel head's logits)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, value=None):
        """The leader's `value` on every rank (a step's inputs)."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the group's rendezvous (a TCPStore at init_method, "tcp://host:port")."""
    if size > 1:
        if dist.is_initialized():  # an earlier engine's group (one group per process)
            dist.destroy_process_group()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
