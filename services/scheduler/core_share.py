"""The cores of one compute domain (workers on the same CPUs or GPU), handed to their steps.

Two workers stepping at once on the same CPUs, each with a thread per core, preempt each other
at every parallel region; so their steps take turns (`serialize`), first come first served,
each with every core. `split` (CPUs only) lets them step side by side instead, each on an equal
share of the cores, while a long prompt is being prefilled and another worker has work: a
decode step is memory-bound and loses little on one core (86 against 55 ms for 32 sequences
here), while waiting for each of the long prompt's chunks on both cores costs it the whole chunk
step. Short prompts still take every core in turn: a burst of them prefills (compute-bound)
twice as fast that way, and its first tokens come sooner (BENCHMARKS.md). So do long ones while
the prompts go first: from when more requests await a first token than sequences decode until
at most one is left (prefill_chunks.py); on half the cores such a backlog would only grow. Nor
is a decode worker that speculates split off: its steps verify drafts and are compute-bound.

Sharing is counted in CPUs: a step takes as many as its worker has threads, so workers whose
threads fit the domain's CPUs together (e.g. 2 + 2 threads on 8 CPUs) step at the same time
whatever the mode. A GPU is one unit: its workers' steps always take turns.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import Callable
from itertools import chain
from typing import AsyncIterator

from kvrelay.scheduler.messages import DECODE, PREFILL
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.step_gate import OWN_CORES, StepGate


class CoreShare:
    """The step gate (step_gate.py) of the workers of one compute domain."""

    def __init__(self, split: bool, long_prompt_tokens: int = 0,
                 num_cpus: int | None = None, *,
                 has_work: Callable[[WorkerRecord], bool]) -> None:
        self.num_cpus = num_cpus  # None: one device, used by one step at a time
        self.has_work = has_work  # queued or running sequences, or KV sends to carry
        self.split = split and num_cpus is not None
        # A prompt with more tokens left to prefill than this is long (0: every prompt is).
        self.long_prompt_tokens = long_prompt_tokens
        self.members: dict[str, WorkerRecord] = {}  # worker id -> its current registration
        self.held: dict[int, int] = {}  # id(worker record) -> CPUs its running step holds
        self.waiting: deque[tuple[WorkerRecord, asyncio.Future]] = deque()

    def join(self, worker: WorkerRecord) -> None:
        self.members = {worker_id: m for worker_id, m in self.members.items() if m.alive}
        self.members[worker.worker_id] = worker

    @property
    def capacity(self) -> int:
        return self.num_cpus or 1

    def own(self, worker: WorkerRecord) -> int:
        """What a step of the worker holds when it runs on all its threads."""
        if self.num_cpus is None:
            return 1
        return min(worker.info.num_threads or self.num_cpus, self.num_cpus)

    @contextlib.asynccontextmanager
    async def turn(self, worker: WorkerRecord) -> AsyncIterator[int]:
        """Held from planning a step to applying its result. Yields the step's thread count:
        0 for all of the worker's own."""
        cores = await self._acquire(worker)
        try:
            yield 0 if cores >= self.own(worker) else cores
        finally:
            self._release(worker)

    async def _acquire(self, worker: WorkerRecord) -> int:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((worker, future))
        self._dispatch()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(worker)  # granted just as the waiter was cancelled
            else:
                self.waiting = deque(w for w in self.waiting if w[1] is not future)
                self._dispatch()
            raise

    def refresh(self) -> None:
        """A worker's work changed: the first waiter's share may have shrunk enough to fit."""
        self._dispatch()

    def contended(self, worker: WorkerRecord) -> bool:
        return any(other is not worker and not future.done() for other, future in self.waiting)

    def _release(self, worker: WorkerRecord) -> None:
        self.held.pop(id(worker), None)
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant turns in arrival order while the cores they need are free; the first waiter
        that does not fit holds back the rest, so no worker is passed over for long."""
        while self.waiting:
            worker, future = self.waiting[0]
            if future.cancelled():
                self.waiting.popleft()
                continue
            cores = self._share(worker)
            if self.capacity - sum(self.held.values()) < cores:
                return
            self.waiting.popleft()
            self.held[id(worker)] = cores
            future.set_result(cores)

    def _share(self, worker: WorkerRecord) -> int:
        """The worker's own threads, or with `split` while a long prompt prefills and the
        active workers' threads oversubscribe the CPUs, an equal share of the CPUs among them:
        the workers stepping now, those with work, and this one."""
        own = self.own(worker)
        if not self.split or not worker.info.num_threads:
            return own  # (a worker that reports no thread count may not honor a lower one)
        active = [m for m in self.members.values()
                  if m is worker or id(m) in self.held or (m.alive and self.has_work(m))]
        if (len(active) < 2 or sum(map(self.own, active)) <= self.capacity
                or _prompts_go_first([m for m in self.members.values() if m.alive])
                or any(_speculates(m) for m in active)
                # (last: it looks up each waiting prompt's cached prefix)
                or not any(self._prefills_long_prompt(m) for m in active)):
            return own
        return max(1, min(own, self.capacity // len(active)))

    def _prefills_long_prompt(self, worker: WorkerRecord) -> bool:
        if worker.role is DECODE or not worker.alive:
            return False
        core = worker.core
        # (a prompt whose prefix is cached is as long as what is left of it)
        return any(core.tokens_to_prefill(request) > self.long_prompt_tokens
                   for request in chain(core.running, core.waiting))


def _prompts_go_first(workers: list[WorkerRecord]) -> bool:
    """A prefill worker's waiting prompts go first (prefill_chunks.py), counted afresh for the
    step about to take its turn: its steps take every core, as a backlog on half of them would
    only grow."""
    decoding = sum(len(w.core.running) for w in workers if w.role is not PREFILL)
    return any(w.core.prompts_go_first(decoding) for w in workers if w.role is PREFILL)


def _speculates(worker: WorkerRecord) -> bool:
    """A decode worker whose next steps verify drafts: they carry several tokens a sequence
    and are compute-bound, so a share of the cores slows them as much as a prefill's (grounded
    workload, 8 at a time: 130 tok/s split against 180 serialized; BENCHMARKS.md)."""
    core = worker.core
    drafter = core.drafter
    return (worker.role is DECODE and drafter is not None and bool(core.running)
            and drafter.config.allows_batch(len(core.running)))


def domain_cpus(domain: str) -> int | None:
    """How many CPUs a compute domain names ("<host>/cpus:0,1,..."); None for a device."""
    match = re.search(r"/cpus:([0-9,]+)", domain)
    return len(match.group(1).split(",")) if match else None


class DomainGates:
    """The step gate of each worker: its compute domain's CoreShare, or its own cores where it
    shares them with no one it knows of (no domain reported, or `overlap`)."""

    def __init__(self, mode: str, long_prompt_tokens: int,
                 has_work: Callable[[WorkerRecord], bool]) -> None:
        self.mode = mode  # serialize, split or overlap
        self.long_prompt_tokens = long_prompt_tokens
        self.has_work = has_work
        self.shares: dict[str, CoreShare] = {}  # compute domain -> the cores its steps share

    def gate_for(self, worker: WorkerRecord) -> StepGate:
        domain = worker.info.compute_domain
        if self.mode == "overlap" or not domain:
            return OWN_CORES
        if domain not in self.shares:
            self.shares[domain] = CoreShare(self.mode == "split", self.long_prompt_tokens,
                                            domain_cpus(domain), has_work=self.has_work)
        share = self.shares[domain]
        share.join(worker)
        return share
