"""The worker's own copy of each sequence it runs: tokens, progress, block table, generator.

The scheduler sends a sequence's full state once (NewSequence) and afterwards only what changed
(ScheduledSequence), so a step message stays small however long the sequences get. Both arrive
as the step protocol's dataclasses (kvrelay.step_messages), converted at the edge (edge.py).
"""
from __future__ import annotations

import torch

from kvrelay.engine.request import Request
from kvrelay.engine.sampler import make_generator
from kvrelay.step_messages import NewSequence, ScheduledSequence


class SequenceTable:
    def __init__(self) -> None:
        self.sequences: dict[str, Request] = {}
        self.block_ids: dict[str, list[list[int]]] = {}  # per KV group, its block table

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, new: NewSequence) -> None:
        params, num_prompt = new.params, new.num_prompt_tokens
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed, new.child_index)
        sequence = Request(new.sequence_id, new.token_ids[:num_prompt], params,
                           frozenset(new.eos_token_ids), generator=generator,
                           adapter_id=new.adapter_id)
        for token_id in new.token_ids[num_prompt:]:
            sequence.append_token(token_id)
        _skip_draws(generator, sequence.num_output_tokens)
        sequence.num_computed_tokens = new.num_computed_tokens
        self.sequences[new.sequence_id] = sequence
        self.block_ids[new.sequence_id] = [list(table) for table in new.block_ids]

    def update(self, scheduled: ScheduledSequence) -> Request:
        sequence = self.sequences.get(scheduled.sequence_id)
        if sequence is None:
            raise KeyError(f"unknown sequence {scheduled.sequence_id!r}")
        for table, new_block_ids in zip(self.block_ids[scheduled.sequence_id],
                                        scheduled.new_block_ids):
            table.extend(new_block_ids)
        for token_id in scheduled.new_token_ids:
            sequence.append_token(token_id)
        return sequence

    def forget(self, sequence_id: str) -> None:
        self.sequences.pop(sequence_id, None)
        self.block_ids.pop(sequence_id, None)


def _skip_draws(generator, num_draws: int) -> None:
    """A seeded sequence draws one uniform per sampled token; one that resumes here after tokens
    sampled elsewhere (the prefill worker, or before a preemption) skips those draws so its
    stream of random numbers continues where it left off."""
    if generator is None:
        return
    for _ in range(num_draws):
        torch.rand(1, dtype=torch.float64, generator=generator)
