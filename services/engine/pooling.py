"""Embeddings: a request with `pooling` set computes its prompt and returns the decoder's final
hidden state (after the last norm, as transformers' last_hidden_state) pooled over its prompt,
L2-normalized: the last token's, or the mean of every token's. It rides the generation path as
a one-token request (its sampled token is dropped by the endpoint): the scheduler's token
budget, chunked prefill and PD placement treat it like any prompt, and it holds no KV once done.

The worker keeps a mean's running sum on the sequence between the chunks of a long prompt."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.step_results import Pooled

@dataclass(frozen=True, slots=True)
class PoolRows:
    """A scheduled item's rows that pooling reads this step."""
    request: object  # the sequence (its running sum lives on it)
    num_rows: int
    restart: bool  # the chunk starts the prompt: any earlier sum is stale (preempted)
    finishes: bool  # the chunk ends the prompt: the vector is complete


def pool_rows(request, start: int, end: int) -> tuple[int, PoolRows] | None:
    """(the first position read, the rows) of positions [start, end) that pooling needs;
    None for a request without pooling or a chunk it reads nothing of."""
    kind = request.params.pooling
    if kind is None:
        return None
    num_prompt = request.num_prompt_tokens
    stop = min(end, num_prompt)
    if kind == "last":
        if stop != num_prompt or start > num_prompt - 1:
            return None
        return num_prompt - 1, PoolRows(request, 1, start == 0, True)
    if stop <= start:
        return None
    return start, PoolRows(request, stop - start, start == 0, stop == num_prompt)


@torch.inference_mode()
def pool(hidden: torch.Tensor, rows: list[PoolRows]) -> list[Pooled]:
    """hidden [P, hidden]: the rows of `rows`, in order. Returns the finished vectors."""
    results, offset = [], 0
    for item in rows:
        chunk = hidden[offset:offset + item.num_rows].float()  # [r, hidden]
        offset += item.num_rows
        request = item.request
        if request.params.pooling == "last":
            vector = chunk[-1]
        else:
            if item.restart or request.pooled_sum is None:
                request.pooled_sum, request.pooled_count = torch.zeros_like(chunk[0]), 0
            request.pooled_sum += chunk.sum(0)
            request.pooled_count += item.num_rows
            if not item.finishes:
                continue
            vector = request.pooled_sum / request.pooled_count
            request.pooled_sum = None
        vector = torch.nn.functional.normalize(vector, dim=0)
        results.append(Pooled(request.sequence_id, tuple(vector.tolist())))
    return results
