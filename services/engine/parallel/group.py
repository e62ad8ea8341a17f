"""A tensor-parallel group as a model's layers see it: this process's rank, the group's size,
and the collectives a sharded layer needs, on torch.distributed (gloo on CPU, NCCL on CUDA);
on CPU the all-reduces and all-gathers go through shared memory (kernels/shm_collectives.py),
gloo only setting up and broadcasting each step's inputs.

A group of one is the default everywhere: its collectives return at once, so the single-rank
model runs exactly as before.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvrelay.kernels.shm_collectives import ShmExchange

# A rank that stops answering takes its group down within this (no collective hangs forever).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    shm: ShmExchange | None = None  # ranks on one host's CPUs

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the row-parallel linears' partial outputs)."""
        if self.size == 1:
            return tensor
        slots = self.shm.exchange(tensor) if self.shm is not None else None
        if slots is None:
            dist.all_reduce(tensor)
            return tensor
        tensor.copy_(slots[0])
        for other in slots[1:]:  # in rank order on every rank: the same bits everywhere
            tensor.add_(other)
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, cols] per rank -> [rows, size * cols], rank 0's columns first (the
        vocab-parallel head's logits)."""
        if self.size == 1:
            return tensor
        slots = self.shm.exchange(tensor) if self.shm is not None else None
        if slots is None:
            slots = [torch.empty_like(tensor) for _ in range(self.size)]
            dist.all_gather(slots, tensor.contiguous())
        return torch.cat(slots, dim=-1)

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
        if device.type == "cpu":
            return TPGroup(rank, size, _shared_slots(rank, size))
    return TPGroup(rank, size)


def _shared_slots(rank: int, size: int) -> ShmExchange:
    """The leader makes the file, every rank maps it, then it is unlinked (the maps stay)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    box = [os.path.join(directory, f"kvrelay-tp-{os.getpid()}-{os.urandom(4).hex()}")
           if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        exchange = ShmExchange(box[0], rank, size, create=True)
    dist.barrier()
    if rank != 0:
        exchange = ShmExchange(box[0], rank, size, create=False)
    dist.barrier()
    if rank == 0:
        os.unlink(box[0])
    return exchange


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
