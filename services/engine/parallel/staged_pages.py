"""A pipeline's KV cache as the KV connector writes it when the stages share no file (stages on
other hosts): the pages of the leader's own layer slots go straight into its cache; the others
wait here until the compute thread sends them down the pipeline ahead of its next step
(ModelRunner.start_step), where each stage writes those of its own slots
(ModelRunner.write_staged_pages).

A decode worker's blocks are scheduled only after their push has completed, and a stage takes
its messages in the order the leader sent them, so a stage always holds a sequence's pages
before the first step that reads them.

With windowed layers (kv_groups.py) a slot index serves a layer of each KV group, so one slot
may belong to layers on several stages: a page goes to every stage whose slots include its slot
(a page of another group's layer lands where no layer of that stage reads it: harmless).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvrelay.engine.kv_pages import KvPages


@dataclass(frozen=True, slots=True)
class KvWrites:
    """The message: per entry (slot, K or V, destination blocks); the pages travel as its
    tensors, one [n, block_size, heads, row_width] per entry."""
    entries: tuple[tuple[int, int, tuple[int, ...]], ...]


class StagedKvPages:
    def __init__(self, local: KvPages, first_slot: int, num_slots: int,
                 remote_slots: set[int]) -> None:
        self.local = local  # the leader's cache of slots first_slot.. (every head)
        self.first_slot = first_slot
        self.total_slots = num_slots
        self.remote_slots = remote_slots  # the slots some other stage holds
        self.lock = threading.Lock()
        self.pending: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    @property
    def num_slots(self) -> int:
        return self.total_slots

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return self.local.page_shape

    def write(self, slot: int, kv: int, block_index: torch.Tensor,
              pages: torch.Tensor) -> None:
        """As KvPages.write (the connector's thread): here, or kept for the other stages."""
        if 0 <= slot - self.first_slot < self.local.num_slots:
            self.local.write(slot - self.first_slot, kv, block_index, pages)
        if slot in self.remote_slots:
            with self.lock:
                self.pending.append((slot, kv, block_index, pages))

    def take_pending(self) -> tuple[KvWrites, list[torch.Tensor]] | None:
        """The compute thread: the pages kept since the last call, as one message."""
        with self.lock:
            pending, self.pending = self.pending, []
        if not pending:
            return None
        entries = tuple((slot, kv, tuple(index.tolist())) for slot, kv, index, _ in pending)
        return KvWrites(entries), [pages for *_, pages in pending]


def write_own(cache_pages: KvPages, first_slot: int, writes: KvWrites,
              tensors: list[torch.Tensor], later_slots: set[int]):
    """A stage: the entries of its own slots (cache_pages: its cache of slots first_slot..);
    returns the message for the stages after it, with the entries of `later_slots` only (sent
    even with none: each stage answers each of the leader's rings with one message)."""
    onward = []
    for entry, pages in zip(writes.entries, tensors):
        slot, kv, block_ids = entry
        if 0 <= slot - first_slot < cache_pages.num_slots:
            cache_pages.write(slot - first_slot, kv, torch.tensor(block_ids), pages)
        if slot in later_slots:
            onward.append((entry, pages))
    return KvWrites(tuple(entry for entry, _ in onward)), [pages for _, pages in onward]
