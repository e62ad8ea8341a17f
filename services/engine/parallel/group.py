"""A tensor-parallel group as a model's layers see it: this process's rank, the group's size,
and the collectives a sharded layer needs, on torch.distributed (gloo on CPU, NCCL on CUDA);
on CPU the all-reduces and all-gathers go through shared memory (kernels/shm_collectives.py) and
so do each step's inputs (step_mailbox.py), gloo only setting up.

A group of one is the default everywhere: its collectives return at once, so the single-rank
model runs exactly as before.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvrelay.engine.parallel.step_mailbox import StepMailbox
from kvrelay.kernels.shm_collectives import ShmExchange, barrier_ops

# A rank that stops answering inside a step takes its group down within this (no collective
# hangs forever); the wait between steps has none (step_mailbox.py).
DEFAULT_TIMEOUT_S = 120.0
# gloo's own timeout, for setting up: ranks load their shards of a large checkpoint and build
# kernels at their own pace between the first collectives.
SETUP_TIMEOUT_S = 1800.0


class GroupBroken(RuntimeError):
    """A collective failed: a rank died or stalled past the timeout. The group cannot go on."""


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    shm: ShmExchange | None = None  # ranks on one host's CPUs
    mailbox: StepMailbox | None = None  # each step's inputs, likewise

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the row-parallel linears' partial outputs)."""
        if self.size == 1:
            return tensor
        slots = self._exchange(tensor)
        if slots is None:
            _collective(dist.all_reduce, tensor)
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
        slots = self._exchange(tensor)
        if slots is None:
            slots = [torch.empty_like(tensor) for _ in range(self.size)]
            _collective(dist.all_gather, slots, tensor.contiguous())
        return torch.cat(slots, dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        if self.shm is None:
            return None
        try:
            return self.shm.exchange(tensor)
        except RuntimeError as exc:
            raise GroupBroken(str(exc)) from exc

    def broadcast_object(self, value=None):
        """The leader's `value` on every rank (a step's inputs)."""
        if self.size == 1:
            return value
        box = [value]
        _collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    def post_step(self, step) -> None:
        """Leader: every other rank's next step (None: leave the group)."""
        if self.mailbox is not None:
            self.mailbox.post(step)
        else:
            self.broadcast_object(step)

    def next_step(self, leader_alive=lambda: True):
        """Follower: the leader's next step, however long the group stays idle."""
        if self.mailbox is not None:
            return self.mailbox.receive(leader_alive)
        return self.broadcast_object(None)


def _collective(operation, *args, **kwargs):
    try:
        return operation(*args, **kwargs)
    except RuntimeError as exc:  # gloo: a peer closed or the timeout passed
        raise GroupBroken(str(exc)) from exc


def init_group(rank: int, size: int, init_method: str, device: torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the group's rendezvous (a TCPStore at init_method, "tcp://host:port")."""
    if size > 1:
        join_process_group(rank, size, init_method, device, timeout_s)
        if device.type == "cpu":
            return TPGroup(rank, size, *_shared_files(rank, size, timeout_s))
    return TPGroup(rank, size)


def join_process_group(rank: int, size: int, init_method: str, device: torch.device,
                       timeout_s: float) -> None:
    if dist.is_initialized():  # an earlier engine's group (one group per process)
        dist.destroy_process_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":
        barrier_ops()  # built (or loaded) before the first collective, not inside one
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S)))


def map_group_files(rank: int, make, suffixes: tuple[str, ...]):
    """The group's shared files under one name the leader picks: make(stem, create) maps
    them, on the leader first (create=True), then on the others; then they are unlinked (the
    maps stay). Returns make's result."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    stem = os.path.join(directory, f"kvrelay-tp-{os.getpid()}-{os.urandom(4).hex()}")
    box = [stem if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    stem = box[0]
    try:
        if rank == 0:
            made = make(stem, True)
        dist.barrier()
        if rank != 0:
            made = make(stem, False)
        dist.barrier()
    finally:  # mapped by every rank by now, or the group failed to form: no file stays behind
        if rank == 0:
            for suffix in suffixes:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stem + suffix)
    return made


def _shared_files(rank: int, size: int, timeout_s: float) -> tuple[ShmExchange, StepMailbox]:
    return map_group_files(rank, lambda stem, create: (
        ShmExchange(stem, rank, size, create=create, timeout_s=timeout_s),
        StepMailbox(stem + ".steps", create=create)), ("", ".steps"))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
