"""The workers of one scheduler: who registered, whose lease holds, who drains, and which of
them share hardware. Each worker gets its own engine `Scheduler` (queues and block pool),
sized from what it registered with."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.spec.drafter import Drafter
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.messages import BOTH, DECODE, PREFILL, Role, WorkerInfo


@dataclass(slots=True, eq=False)
class WorkerRecord:
    info: WorkerInfo
    core: Scheduler  # this worker's queues and block pool
    lease_deadline: float  # monotonic
    draining: bool = False
    alive: bool = True
    # sequence id -> per KV group, the blocks it was sent
    known_blocks: dict[str, list[int]] = field(default_factory=dict)
    forget: list[str] = field(default_factory=list)  # sequence ids to drop at the next step

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> Role:
        return self.info.role

    @property
    def has_core_work(self) -> bool:
        return bool(self.core.running) or bool(self.core.waiting)

    def load(self) -> tuple[int, float]:
        return (len(self.core.running) + len(self.core.waiting), self.core.kv.usage)


class WorkerRegistry:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerRecord] = {}
        # Speculative decoding on the workers that decode: one drafter for all of them, so the
        # suffix proposer's global tree learns from every worker's outputs.
        spec_config = config.engine.speculative_config
        self.drafter = None if spec_config is None else Drafter(spec_config)

    def register(self, info: WorkerInfo) -> WorkerRecord | None:
        """Adds the worker; returns the live record it replaces, if any (the caller ends what
        that one held). Raises ValueError when the worker cannot join this group."""
        for other in self.workers.values():
            if other.alive and _identity(other.info) != _identity(info):
                raise ValueError(f"worker {info.worker_id} ({_describe(info)}) does not match "
                                 f"{other.worker_id} ({_describe(other.info)})")
        if self.config.engine.enable_lora and not info.max_loras:
            raise ValueError(f"worker {info.worker_id} runs without --enable-lora, and this "
                             "scheduler serves LoRA adapters")
        replaced = self.workers.get(info.worker_id)
        core = Scheduler(self._engine_config(info), info.num_blocks, info.max_model_len,
                         info.attention_crossover,
                         None if info.role is PREFILL else self.drafter,
                         info.kv_group_windows)
        self.workers[info.worker_id] = WorkerRecord(info, core,
                                                    time.monotonic() + self.config.lease_s)
        return replaced if replaced is not None and replaced.alive else None

    def _engine_config(self, info: WorkerInfo):
        # each step of the worker mixes at most as many adapters as it has slots
        config = replace(self.config.engine, block_size=info.block_size,
                         max_loras=info.max_loras or self.config.engine.max_loras)
        if info.role is PREFILL and self.config.prefill_max_num_batched_tokens:
            config = replace(config,
                             max_num_batched_tokens=self.config.prefill_max_num_batched_tokens)
        return config

    def heartbeat(self, worker_id: str, draining: bool) -> tuple[WorkerRecord | None, bool]:
        """The worker (None: unknown or dead, it must register again) and whether it started
        draining with this heartbeat."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return None, False
        worker.lease_deadline = time.monotonic() + self.config.lease_s
        started = draining and not worker.draining
        worker.draining = worker.draining or draining
        return worker, started

    def extend_leases(self, seconds: float) -> None:
        """Time this scheduler could not run (its loop stalled) is not a worker's silence: its
        heartbeats were waiting to be handled."""
        for worker in self.workers.values():
            if worker.alive:
                worker.lease_deadline += seconds

    def expired(self, now: float) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.alive and w.lease_deadline < now]

    # ---- who can take work ----------------------------------------------------------------------
    def live(self, *roles: Role) -> list[WorkerRecord]:
        return [w for w in self.workers.values()
                if w.alive and not w.draining and w.role in roles]

    @property
    def pd_ready(self) -> bool:
        return bool(self.live(PREFILL)) and bool(self.live(DECODE))

    @property
    def ready(self) -> bool:
        return self.pd_ready or bool(self.live(BOTH))

    @property
    def max_model_len(self) -> int:
        lengths = [w.info.max_model_len for w in self.workers.values() if w.alive]
        return min(lengths) if lengths else 0

    @property
    def model(self) -> str:
        names = [w.info.model for w in self.workers.values() if w.alive]
        return names[0] if names else ""

    # ---- shared hardware ------------------------------------------------------------------------
    def shares_compute_with_decodes(self, worker: WorkerRecord) -> bool:
        """A prefill worker whose compute domain a decode worker with running sequences
        shares: its steps make those sequences wait (or slow them, with overlapping steps)."""
        return self.decodes_sharing_compute(worker) > 0

    def decodes_sharing_compute(self, worker: WorkerRecord) -> int:
        """For a prefill worker: the sequences running on the other workers of its compute
        domain, which its steps make wait."""
        if worker.role is not PREFILL or not worker.info.compute_domain:
            return 0
        return sum(len(other.core.running) for other in self.workers.values()
                   if other.alive and other.role is not PREFILL
                   and other.info.compute_domain == worker.info.compute_domain)

    def step_budget(self, worker: WorkerRecord) -> int | None:
        """This step's token budget when it differs from the worker's own: the opt-in cap on
        a prefill worker's steps while it shares compute with running decodes."""
        limit = self.config.shared_prefill_max_num_batched_tokens
        if limit and self.config.shared_compute_steps != "overlap" \
                and self.shares_compute_with_decodes(worker):
            return min(limit, worker.core.config.max_num_batched_tokens)
        return None


def _identity(info: WorkerInfo) -> tuple:
    """What every worker of one group must agree on."""
    return (info.block_size, info.dtype, info.model, info.kv_group_windows,
            info.kv_cache_dtype or info.dtype)


def _describe(info: WorkerInfo) -> str:
    return (f"{info.model}, {info.dtype}, KV cache {info.kv_cache_dtype or info.dtype}, block "
            f"{info.block_size}, windows {list(info.kv_group_windows)}")
