"""Runs one step of the scheduler's plan on this worker: varlen forward pass, then sampling."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.api.kvrelay.v1 import worker_pb2
from kvrelay.wire import logprob_to_proto
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.engine.spec.verify import EmittedRun, sample_items
from kvrelay.engine.structured.backend import bitmask_words
from kvrelay.worker.sequences import SequenceTable
from kvrelay.worker.step_threads import StepThreads


@dataclass(slots=True)
class PreparedStep:
    step_id: int
    items: list[ScheduledRequest]
    num_threads: int = 0  # 0: all of the worker's
    # seq id -> its grammar's allowed tokens this step (the scheduler's bitmask, as sent)
    bitmasks: dict[str, bytes] = field(default_factory=dict)


class StepExecutor:
    def __init__(self, runner: ModelRunner, num_threads: int = 0) -> None:
        self.runner = runner
        self.threads = StepThreads(num_threads) if num_threads else None
        self.sampler = Sampler()
        self.table = SequenceTable()

    def apply(self, request: worker_pb2.StepRequest) -> PreparedStep:
        """Update the sequence table from a step message (cheap; runs on the event loop)."""
        for seq_id in request.finished_seq_ids:
            self.table.forget(seq_id)
        for new in request.new_sequences:
            self.table.add(new)
        items, bitmasks = [], {}
        for scheduled in request.scheduled:
            sequence = self.table.update(scheduled)
            items.append(ScheduledRequest(sequence, scheduled.num_new_tokens,
                                          self.table.block_ids[scheduled.seq_id],
                                          list(scheduled.draft_token_ids)))
            if scheduled.token_bitmask:
                bitmasks[scheduled.seq_id] = scheduled.token_bitmask
        return PreparedStep(request.step_id, items, request.num_threads, bitmasks)

    def execute(self, step: PreparedStep, on_layer_done=None) -> list[worker_pb2.SampledToken]:
        """The forward pass and sampling (heavy; runs in the compute thread)."""
        if not step.items:
            return []
        if self.threads is not None:
            self.threads.use(step.num_threads)
        step_input = self.runner.prepare(step.items)
        logits = self.runner.execute(step_input, on_layer_done)  # [S, vocab]
        for item in step.items:
            item.request.num_computed_tokens += item.num_new_tokens
        if not step_input.sample_rows:
            return []
        items = [step.items[row] for row in dict.fromkeys(step_input.sample_rows)]
        bitmasks = [_bitmask_rows(step.bitmasks.get(item.request.sequence_id),
                                  1 + len(item.draft_token_ids), logits.shape[1])
                    for item in items]
        runs = sample_items(self.sampler, logits, items, bitmasks)
        return [self._emit(item, run) for item, run in zip(items, runs)]

    @staticmethod
    def _emit(item: ScheduledRequest, run: EmittedRun) -> worker_pb2.SampledToken:
        sequence = item.request
        # Rejected drafts' KV is garbage: the next step recomputes from the last accepted one.
        sequence.num_computed_tokens -= len(item.draft_token_ids) - (len(run.token_ids) - 1)
        message = worker_pb2.SampledToken(seq_id=sequence.sequence_id, token_ids=run.token_ids)
        for token_id, entry, rank in zip(run.token_ids, run.logprobs, run.ranks):
            sequence.append_token(token_id)
            if entry is not None:
                message.logprobs.append(logprob_to_proto(entry, rank, token_id,
                                                         sequence.params.logprobs))
        return message


def _bitmask_rows(packed: bytes | None, num_rows: int, vocab_size: int) -> torch.Tensor | None:
    """The scheduler's packed bitmasks -> int32 [num_rows, W]; a wrong size is the scheduler's
    bug."""
    if not packed:
        return None
    words = bitmask_words(vocab_size)
    if len(packed) != 4 * words * num_rows:
        raise ValueError(f"token bitmask of {len(packed)} bytes for {num_rows} positions and a "
                         f"vocabulary of {vocab_size}")
    return torch.frombuffer(bytearray(packed), dtype=torch.int32).view(num_rows, words)
