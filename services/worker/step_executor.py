"""Runs one step of the scheduler's plan on this worker: varlen forward pass, then sampling."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.api.kvrelay.v1 import worker_pb2
from services.wire import logprob_to_proto
from services.engine.model_runner import ModelRunner
from services.engine.sampler import Sampler, SamplingRow
from services.engine.scheduler import ScheduledRequest
from services.engine.stop_checker import banned_token_ids
from services.engine.structured.backend import bitmask_words
from services.worker.sequences import SequenceTable
from services.worker.step_threads import StepThreads


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
                                          self.table.block_ids[scheduled.seq_id]))
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
        sampled = []
        if step_input.sample_rows:
            sampled = self._sample(logits, [step.items[row] for row in step_input.sample_rows],
                                   step.bitmasks)
        for item in step.items:
            item.request.num_computed_tokens += item.num_new_tokens
        return sampled

    def _sample(self, logits, items: list[ScheduledRequest],
                bitmasks: dict[str, bytes]) -> list[worker_pb2.SampledToken]:
        sequences = [item.request for item in items]
        rows = [SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                            output_token_ids=seq.output_token_ids, generator=seq.generator,
                            banned_token_ids=banned_token_ids(seq),
                            token_bitmask=_bitmask_row(bitmasks.get(seq.request_id),
                                                       logits.shape[1]))
                for seq in sequences]
        result = self.sampler(logits, rows)
        sampled = []
        for seq, token_id, entry, rank in zip(sequences, result.token_ids, result.logprobs,
                                              result.ranks):
            seq.append_token(token_id)
            message = worker_pb2.SampledToken(seq_id=seq.request_id, token_id=token_id)
            if entry is not None:
                message.logprob.CopyFrom(logprob_to_proto(entry, rank, token_id,
                                                          seq.params.logprobs))
            sampled.append(message)
        return sampled


def _bitmask_row(packed: bytes | None, vocab_size: int) -> torch.Tensor | None:
    """The scheduler's packed bitmask -> int32 [W]; a wrong size is the scheduler's bug."""
    if not packed:
        return None
    if len(packed) != 4 * bitmask_words(vocab_size):
        raise ValueError(f"token bitmask of {len(packed)} bytes for a vocabulary of {vocab_size}")
    return torch.frombuffer(bytearray(packed), dtype=torch.int32)
