"""vLLM's prompt_logprobs: the logprob of each prompt token (after the first) given the tokens
before it, its rank, and the top k alternatives, computed where the prompt is computed (the
prefill worker in PD) from the same forward pass, chunk by chunk.

The rows of a prompt chunk are kept past the final norm beside the sampled rows (ModelRunner);
their logits are made here a slice at a time, so one chunk of a long prompt costs at most
SLICE_ROWS x vocab floats at once, not its length's."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.step_results import PromptLogprobs, TokenLogprob

SLICE_ROWS = 128


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A scheduled item's rows whose next token is a prompt token."""
    sequence_id: str
    first_position: int  # the prompt position the first row predicts (>= 1)
    target_ids: tuple[int, ...]  # the prompt tokens the rows predict, one per row
    num_top: int


def prompt_rows(request, start: int, end: int) -> PromptRows | None:
    """The rows of positions [start, end) that predict a prompt token, for a request that asks
    for prompt logprobs; None otherwise."""
    num_top = request.params.prompt_logprobs
    if num_top is None:
        return None
    stop = min(end, request.num_prompt_tokens - 1)  # position p predicts token p + 1
    if stop <= start:
        return None
    return PromptRows(request.sequence_id, start + 1,
                      tuple(request.all_token_ids[start + 1:stop + 1]), num_top)


@torch.inference_mode()
def compute(logits_of, hidden: torch.Tensor, rows: list[PromptRows]) -> list[PromptLogprobs]:
    """logits_of: [r, hidden] -> [r, vocab] float32 (the model's head); hidden [P, hidden]: the
    rows of `rows`, in order."""
    results, offset = [], 0
    for item in rows:
        count = len(item.target_ids)
        targets = torch.tensor(item.target_ids, dtype=torch.int64, device=hidden.device)
        entries = []
        for first in range(0, count, SLICE_ROWS):
            last = min(first + SLICE_ROWS, count)
            logprobs = torch.log_softmax(logits_of(hidden[offset + first:offset + last]), -1)
            entries += _entries(logprobs, targets[first:last], item.num_top)
        results.append(PromptLogprobs(item.sequence_id, item.first_position, tuple(entries)))
        offset += count
    return results


def _entries(logprobs: torch.Tensor, targets: torch.Tensor,
             num_top: int) -> list[TokenLogprob]:
    # logprobs [r, vocab] float32, targets [r] int64
    chosen = logprobs.gather(1, targets[:, None])  # [r, 1]
    ranks = (logprobs > chosen).sum(1) + 1  # [r]
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=1)
        tops = [tuple(zip(ids, values)) for ids, values
                in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [()] * len(targets)
    return [TokenLogprob(token_id, value, rank, top) for token_id, value, rank, top
            in zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), tops)]
