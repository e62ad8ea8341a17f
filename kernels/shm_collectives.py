"""Collectives through shared memory for tensor-parallel ranks on one host (CPU).

gloo moves every all-reduce through the loopback TCP stack; a split model does two a layer, so
at 30 layers a decode step waited on 61 of them (measured: TP=2 at 0.50x of one rank on
chat-64). Here each rank copies its tensor into its slot of a shared file, publishes the round
(kernels/csrc/shm_barrier.cpp: one counter a rank, a spin until every rank has published), and
reads every rank's slot: a sum for all-reduce, a concatenation for all-gather, in rank order, so
every rank computes the same bits. Two sets of slots alternate by round: a rank cannot write
round r + 2 before every rank has published r + 1, which each does only after reading round r.
A tensor larger than a slot goes through gloo (the caller's fallback).
"""
from __future__ import annotations

import functools
import mmap
import os

import torch

from kvrelay.kernels.native_build import load_extension

COUNTER_WORDS = 8  # one rank's counter and its cache line (64 bytes)
SLOT_BYTES = 16 << 20  # a [8192, 576] bf16 activation; a 128-row float32 logits shard
TIMEOUT_S = 120.0  # as the group's gloo timeout: a rank gone takes the group down


@functools.cache
def barrier_ops():
    """The built extension (arrive_and_wait), or None where it cannot be built."""
    return load_extension("kvrelay_shm_barrier", ("shm_barrier.cpp",), ["-O2"],
                          "the shared-memory all-reduce", "gloo runs every collective")


def map_shared_file(path: str, num_bytes: int, create: bool) -> mmap.mmap:
    """A file the ranks of a group share, mapped: made (zeros, owner only) by one rank, opened
    by the others."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    descriptor = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(descriptor, num_bytes)
        return mmap.mmap(descriptor, num_bytes)
    finally:
        os.close(descriptor)


class ShmExchange:
    """Slots for `size` ranks in the file at `path` (the leader creates it, `create`)."""

    def __init__(self, path: str, rank: int, size: int, create: bool,
                 slot_bytes: int = SLOT_BYTES, timeout_s: float = TIMEOUT_S) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.timeout_s = timeout_s  # a rank gone or stopped this long takes the group down
        self.header = size * COUNTER_WORDS * 8
        self.map = map_shared_file(path, self.header + 2 * size * slot_bytes, create)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        self.counters = self.buffer[:self.header].view(torch.int64)
        self.round = 0
        self.ops = barrier_ops()

    def exchange(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (views into the slots, valid until the round after next), or
        None where it does not fit a slot."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.ops is None or nbytes > self.slot_bytes:
            return None
        self.round += 1
        first = (self.round & 1) * self.size
        slots = [self._slot(first + rank, tensor) for rank in range(self.size)]
        slots[self.rank].copy_(tensor)
        self.ops.arrive_and_wait(self.counters, self.rank, self.size, self.round, self.timeout_s)
        return slots

    def _slot(self, index: int, like: torch.Tensor) -> torch.Tensor:
        start = self.header + index * self.slot_bytes
        nbytes = like.numel() * like.element_size()
        return self.buffer[start:start + nbytes].view(like.dtype).view(like.shape)
