"""Runs one step of the scheduler's plan on this worker: the order (kvrelay.step_messages)
updates the sequence table into the engine's batch (a SchedulerOutput, as the offline engine
core runs it), then the varlen forward pass and sampling."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.model_runner import ModelRunner, PendingStep, StepInput
from kvrelay.engine.parallel.group import GroupBroken
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvrelay.engine.spec.verify import EmittedRun, sample_items
from kvrelay.engine.structured.backend import bitmask_words
from kvrelay.step_messages import Sampled, StepOrder, StepOutcome, token_logprob
from kvrelay.worker.rank_group import group_broken
from kvrelay.worker.sequences import SequenceTable
from kvrelay.worker.step_threads import StepThreads


class StepExecutor:
    def __init__(self, runner: ModelRunner, num_threads: int = 0) -> None:
        self.runner = runner
        self.threads = StepThreads(num_threads) if num_threads else None
        self.sampler = Sampler()
        self.table = SequenceTable()

    def held_adapters(self) -> frozenset[int]:
        """The LoRA adapters of the sequences this worker holds (their slots are kept); called
        on the compute thread (list() copies the values in one go, under the GIL)."""
        return frozenset(sequence.adapter_id for sequence in list(self.table.sequences.values()))

    def apply(self, order: StepOrder) -> SchedulerOutput:
        """Update the sequence table from the order; its batch, one item per order.scheduled
        in that order (cheap; runs on the event loop)."""
        for sequence_id in order.finished_sequence_ids:
            self.table.forget(sequence_id)
        for new in order.new_sequences:
            self.table.add(new)
        return SchedulerOutput([
            ScheduledRequest(self.table.update(scheduled), scheduled.num_new_tokens,
                             self.table.block_ids[scheduled.sequence_id],
                             list(scheduled.draft_token_ids))
            for scheduled in order.scheduled])

    def execute(self, order: StepOrder, batch: SchedulerOutput,
                on_layer_done=None) -> StepOutcome:
        """The forward pass and sampling of `apply`'s batch (heavy; runs in the compute
        thread)."""
        return self.finish(self.start(order, batch, on_layer_done))

    def start(self, order: StepOrder, batch: SchedulerOutput,
              on_layer_done=None) -> StartedStep:
        """The forward pass as far as this process takes it (all of it, or a pipeline's first
        stage: the next step may start before `finish` collects this one)."""
        started = StartedStep(order, batch)
        if not batch.scheduled:
            return started
        if self.threads is not None:
            self.threads.use(order.num_threads)
        started.step_input = self.runner.prepare(batch.scheduled)
        started.pending = _in_group(self.runner.start_step, started.step_input, on_layer_done)
        return started

    def finish(self, started: StartedStep) -> StepOutcome:
        """The step's outputs and sampling."""
        order, batch = started.order, started.batch
        if started.pending is None:
            return StepOutcome(order.step_id)
        result = _in_group(self.runner.finish_step, started.pending)
        for item in batch.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        sampled = self._sample(order, batch, started.step_input, result.logits)  # [S, vocab]
        return StepOutcome(order.step_id, tuple(sampled), tuple(result.prompt_logprobs),
                           tuple(result.pooled))

    def _sample(self, order: StepOrder, batch: SchedulerOutput, step_input,
                logits: torch.Tensor) -> list[Sampled]:
        if not step_input.sample_rows:
            return []
        rows = list(dict.fromkeys(step_input.sample_rows))  # indexes of batch and order alike
        items = [batch.scheduled[row] for row in rows]
        bitmasks = [_bitmask_rows(order.scheduled[row].token_bitmask,
                                  1 + len(item.draft_token_ids), logits.shape[1])
                    for row, item in zip(rows, items)]
        runs = sample_items(self.sampler, logits, items, bitmasks)
        return [self._emit(item, run) for item, run in zip(items, runs)]

    @staticmethod
    def _emit(item: ScheduledRequest, run: EmittedRun) -> Sampled:
        sequence = item.request
        # Rejected drafts' KV is garbage: the next step recomputes from the last accepted one.
        sequence.num_computed_tokens -= len(item.draft_token_ids) - (len(run.token_ids) - 1)
        for token_id in run.token_ids:
            sequence.append_token(token_id)
        num_top = sequence.params.logprobs
        if num_top is None:  # the sampler made no logprob entries (the usual, hot case)
            return Sampled(sequence.sequence_id, tuple(run.token_ids))
        return Sampled(sequence.sequence_id, tuple(run.token_ids), tuple(
            token_logprob(entry, rank, token_id, num_top)
            for token_id, entry, rank in zip(run.token_ids, run.logprobs, run.ranks)))


@dataclass(slots=True)
class StartedStep:
    order: StepOrder
    batch: SchedulerOutput
    step_input: StepInput | None = None  # None: nothing scheduled
    pending: PendingStep | None = None


def _in_group(call, *args):
    try:
        return call(*args)
    except GroupBroken as exc:  # a rank died or stalled: no step can run any more
        group_broken(str(exc))
        raise


def _bitmask_rows(packed: bytes, num_rows: int, vocab_size: int) -> torch.Tensor | None:
    """The scheduler's packed bitmasks -> int32 [num_rows, W] (None for none); a wrong size is
    the scheduler's bug."""
    if not packed:
        return None
    words = bitmask_words(vocab_size)
    if len(packed) != 4 * words * num_rows:
        raise ValueError(f"token bitmask of {len(packed)} bytes for {num_rows} positions and a "
                         f"vocabulary of {vocab_size}")
    return torch.frombuffer(bytearray(packed), dtype=torch.int32).view(num_rows, words)
