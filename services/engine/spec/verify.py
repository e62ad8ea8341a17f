"""One step's sampling, speculative or not: the logits rows of each sampled item become the
tokens it emits. A speculative item has a row after its last token and one after each draft;
row j is sampled as if the first j drafts had been emitted (their penalties, bans and grammar
mask apply), so accepting drafts while they equal what would have been sampled emits exactly
what plain decoding would. Shared by the offline engine and the worker."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.sampler import Sampler, SamplingRow
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.engine.stop_checker import banned_token_ids


@dataclass(slots=True)
class EmittedRun:
    """What one sampled item emits: its accepted drafts, then the token sampled after them."""
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per emitted token: the request's logprobs
    ranks: list[int | None]


def sampling_rows(items: list[ScheduledRequest],
                  bitmasks: list[torch.Tensor | None]) -> list[SamplingRow]:
    """bitmasks: per item, its grammar's masks int32 [1 + drafts, words], or None."""
    rows = []
    for item, masks in zip(items, bitmasks):
        request, drafts = item.request, item.draft_token_ids
        for position in range(1 + len(drafts)):
            emitted = drafts[:position]
            rows.append(SamplingRow(
                params=request.params, prompt_token_ids=request.prompt_token_ids,
                output_token_ids=(request.output_token_ids + emitted if emitted
                                  else request.output_token_ids),
                generator=request.generator,
                banned_token_ids=banned_token_ids(request, emitted),
                token_bitmask=None if masks is None else masks[position],
                draft_token_id=drafts[position] if position < len(drafts) else None))
    return rows


def sample_items(sampler: Sampler, logits: torch.Tensor, items: list[ScheduledRequest],
                 bitmasks: list[torch.Tensor | None]) -> list[EmittedRun]:
    """logits [sum(1 + drafts), V], the rows of the items in order."""
    result = sampler(logits, sampling_rows(items, bitmasks))
    runs, row = [], 0
    for item in items:
        drafts = item.draft_token_ids
        num_emitted = 1
        while num_emitted <= len(drafts) and result.token_ids[row + num_emitted - 1] == \
                drafts[num_emitted - 1]:
            num_emitted += 1  # draft accepted: the next row's token follows it
        emitted = slice(row, row + num_emitted)
        runs.append(EmittedRun(result.token_ids[emitted], result.logprobs[emitted],
                               result.ranks[emitted]))
        row += 1 + len(drafts)
    return runs
