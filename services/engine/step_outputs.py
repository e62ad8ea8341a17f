"""A step's sampled tokens applied to its sequences, the one place that does it for the offline
engine (EngineCore.step) and the scheduler service (the worker's step results) alike.

The engine scheduler advances each sequence's progress, appends the tokens one at a time with
the stop checks after each (stop_checker.py), and finishes what must stop, freeing its blocks
(Scheduler.update_from_output); what each sequence gained is then read back as one update."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class SequenceUpdate:
    """What one step did to one sequence."""
    request: Request
    new_token_ids: list[int]
    new_logprobs: Sequence  # one entry per new token, in the caller's form; empty without
    finished: bool


def apply_step_outputs(scheduler: Scheduler, output: SchedulerOutput,
                       sampled: Mapping[str, list[int]],
                       logprobs: Mapping[str, Sequence]) -> list[SequenceUpdate]:
    """The updates of the sequences that gained tokens, in scheduled order.
    sampled: per sequence id, the tokens the step emitted (a verified speculative step: its
    accepted drafts, then the token sampled after them); logprobs: per sequence id, an entry
    per emitted token, where the sequence asked for them."""
    num_before = {item.request.sequence_id: item.request.num_output_tokens
                  for item in output.scheduled}
    finished = {request.sequence_id
                for request in scheduler.update_from_output(output, sampled)}
    updates = []
    for item in output.scheduled:
        request = item.request
        # fewer than the step emitted where a stop came inside an accepted run; none for a
        # sequence that ended (aborted) while the step ran. A finished one took at least the
        # token that ended it.
        num_new = request.num_output_tokens - num_before[request.sequence_id]
        if num_new <= 0:
            continue
        updates.append(SequenceUpdate(
            request, request.output_token_ids[-num_new:],
            logprobs.get(request.sequence_id, ())[:num_new], request.sequence_id in finished))
    return updates
