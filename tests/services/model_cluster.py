"""The cluster driver with real workers: each step the scheduler plans runs, through the wire's
messages (both services' edges), on a worker's own StepExecutor (sequence table, forward pass,
sampler) with its own KV cache, and a KV send copies the pages from the prefill worker's cache
into the decode worker's. The workers share one ModelRunner's weights; nothing else is shared,
so a worker declared dead takes its sequences and its pages with it, as a killed process
would."""
from __future__ import annotations

import copy
import dataclasses

import torch

from kvrelay.engine.model_runner import ModelRunner
from kvrelay.scheduler import edge as scheduler_edge
from kvrelay.scheduler.messages import Role, Sampled, SendOrder, StepOutcome, WorkerInfo
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.worker import edge as worker_edge
from kvrelay.worker.step_executor import StepExecutor
from tests.services.cluster_driver import BLOCK_SIZE, ClusterDriver, InFlightStep, worker_info


def model_worker_info(runner: ModelRunner, worker_id: str, role: Role, num_blocks: int,
                      vocab_size: int, eos_token_ids: tuple[int, ...],
                      max_model_len: int = 512) -> WorkerInfo:
    assert runner.block_size == BLOCK_SIZE
    return dataclasses.replace(worker_info(worker_id, role, num_blocks, max_model_len,
                                           kv_group_windows=runner.kv_layout.windows),
                               vocab_size=vocab_size, eos_token_ids=eos_token_ids)


class ModelClusterDriver(ClusterDriver):
    def __init__(self, runner: ModelRunner, workers: list[WorkerInfo], **config) -> None:
        self.runner = runner
        self.executors: dict[str, StepExecutor] = {}  # worker instance id -> its executor
        super().__init__(workers, **config)

    def register(self, info: WorkerInfo) -> None:
        """A fresh worker process: an empty sequence table and a zeroed KV cache."""
        runner = copy.copy(self.runner)  # the weights are shared, the cache is its own
        runner.num_blocks = info.num_blocks
        runner.kv_cache = torch.zeros((runner.slots_per_block, 2, info.num_blocks, BLOCK_SIZE,
                                       runner.num_kv_heads, runner.head_dim), dtype=runner.dtype)
        runner.kv_caches = [(runner.kv_cache[slot][0], runner.kv_cache[slot][1])
                            for slot in runner.kv_layout.layer_slot]
        self.executors[info.instance_id] = StepExecutor(runner)
        super().register(info)

    def _run_step(self, worker: WorkerRecord, step: InFlightStep) -> list[Sampled]:
        executor = self.executors[worker.info.instance_id]
        order = worker_edge.step_from_proto(scheduler_edge.step_to_proto(step.plan.order))
        outcome = executor.execute(order, executor.apply(order))
        for send in order.kv_sends:  # the step computed (or had) their pages: out they go
            self._push(executor, send)
        result = worker_edge.outcome_to_proto(outcome)
        return list(scheduler_edge.outcome_from_proto(result).sampled)

    def _push(self, source: StepExecutor, send: SendOrder) -> None:
        destination = self.executors[send.dst_instance_id]
        src = torch.tensor(send.src_block_ids, dtype=torch.long)
        dst = torch.tensor(send.dst_block_ids, dtype=torch.long)
        destination.runner.kv_cache[:, :, dst] = source.runner.kv_cache[:, :, src]
