"""What a worker's step loop asks before each step: may it step now, and on how many threads.
A worker that shares its hardware with no one steps whenever it has work, on all its threads;
workers of one compute domain get their turns from core_share.py."""
from __future__ import annotations

import contextlib
from typing import AsyncContextManager, AsyncIterator, Protocol

from kvrelay.scheduler.registry import WorkerRecord


class StepGate(Protocol):
    def turn(self, worker: WorkerRecord) -> AsyncContextManager[int]:
        """Held from planning a step to applying its result; yields the step's thread count
        (0: all of the worker's own)."""

    def refresh(self) -> None:
        """A worker's work changed: a waiting turn may be granted now."""

    def contended(self, worker: WorkerRecord) -> bool:
        """Another worker waits for a turn: the worker's step loop lets go after this step
        rather than plan the next one ahead (worker_link.py)."""


class OwnCores:
    @contextlib.asynccontextmanager
    async def turn(self, worker: WorkerRecord) -> AsyncIterator[int]:
        yield 0

    def refresh(self) -> None:
        pass

    def contended(self, worker: WorkerRecord) -> bool:
        return False


OWN_CORES = OwnCores()
