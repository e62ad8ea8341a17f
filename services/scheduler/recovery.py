"""A sample whose worker died, or whose KV pages never landed, starts over on a live worker.

The scheduler holds every sample's tokens, so nothing is lost with the worker: the sample is
re-prefilled with its prompt and the tokens generated so far as one prompt (its prefix still in
the prefix cache where the new worker has it) and goes on from there, with its remaining
`max_tokens` and `min_tokens`, its grammar's state, and its client's stream untouched. Greedy
output continues exactly where it stopped. What the fold changes: frequency and presence
penalties no longer count the tokens from before the recovery (they are prompt tokens now),
and a seeded sample's random stream starts again from its seed.
"""
from __future__ import annotations

import dataclasses

from services.engine.request import Request
from services.scheduler.records import SampleRecord


def resumed_request(sample: SampleRecord) -> tuple[Request, int]:
    """The sample's engine request to start over elsewhere, and how many output tokens went
    into its prompt."""
    old = sample.request
    num_outputs = old.num_output_tokens
    params = old.params
    if num_outputs:
        max_tokens = None if params.max_tokens is None else params.max_tokens - num_outputs
        params = dataclasses.replace(params, max_tokens=max_tokens,
                                     min_tokens=max(0, params.min_tokens - num_outputs))
    request = Request(sample.seq_id, list(old.all_token_ids), params, old.eos_token_ids,
                      old.priority, old.arrival_time, old.cache_salt)
    request.grammar = old.grammar  # it has taken every token so far: it goes on from there
    return request, num_outputs
