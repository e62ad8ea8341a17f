"""Batched logits edits of the sampler (bans, penalties) and its logprobs.

Each function works on a whole [B, V] batch with vectorized ops. Sparse edits (bans, penalties)
address the flattened logits by `row * V + token`, so their cost follows the number of tokens
involved, not B * V.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from kvrelay.kernels import native_elementwise


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, each row's argmax (the first on ties, as torch.max). On CPU
    in the native pass: torch's max over 49,152 logits a row took 2.5 ms at 64 rows."""
    ops = native_elementwise.elementwise_ops() if logits.device.type == "cpu" else None
    if ops is None:
        return logits.float().max(-1).indices
    return native_elementwise.argmax_rows(ops, logits.float().contiguous())


def flat_token_keys(row_ids: list[int], token_lists: list[list[int]], vocab_size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into the flattened [B * V] logits of each (row, token) pair, in list order, and
    the row of each: (keys [N], rows [N])."""
    num_tokens = sum(len(tokens) for tokens in token_lists)
    tokens = torch.from_numpy(
        np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=num_tokens))
    if num_tokens and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token id outside the vocabulary of {vocab_size}")
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lengths)
    return (rows * vocab_size + tokens).to(device), rows.to(device)


def ban_tokens_(logits: torch.Tensor, row_ids: list[int], banned: list[list[int]]) -> None:
    """logits [B, V], contiguous, modified in place: banned tokens get -inf."""
    keys, _ = flat_token_keys(row_ids, banned, logits.shape[1], logits.device)
    logits.view(-1).index_fill_(0, keys, float("-inf"))


def apply_penalties_(logits: torch.Tensor, row_ids: list[int], prompts: list[list[int]],
                     outputs: list[list[int]], repetition: list[float],
                     frequency: list[float], presence: list[float]) -> None:
    """logits [B, V], contiguous, modified in place for the rows in row_ids.

    Repetition (HF/vLLM): over tokens of the prompt or the output, positive logits are divided
    by the penalty and the others multiplied. Then frequency subtracts `f * count` and presence
    `p` for every token in the output.

    Tokens repeat within a row, and no sort removes the repeats: a once-per-token edit reads
    every old value first and then writes, so repeats write the same new value; frequency
    adds once per occurrence.
    """
    num_rows, vocab_size = logits.shape
    flat = logits.view(-1)

    def per_row(values: list[float], neutral: float) -> torch.Tensor:  # [B]
        full = [neutral] * num_rows
        for row, value in zip(row_ids, values):
            full[row] = value
        return torch.tensor(full, dtype=logits.dtype, device=logits.device)

    rep = [i for i, value in enumerate(repetition) if value != 1.0]
    if rep:
        keys, rows = flat_token_keys([row_ids[i] for i in rep],
                                     [prompts[i] + outputs[i] for i in rep], vocab_size,
                                     logits.device)
        penalty = per_row(repetition, 1.0)[rows]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)

    counted = [i for i in range(len(row_ids)) if frequency[i] != 0.0 or presence[i] != 0.0]
    if counted:
        keys, rows = flat_token_keys([row_ids[i] for i in counted], [outputs[i] for i in counted],
                                     vocab_size, logits.device)
        if any(frequency[i] != 0.0 for i in counted):
            flat.index_add_(0, keys, -per_row(frequency, 0.0)[rows])
        if any(presence[i] != 0.0 for i in counted):
            flat[keys] = flat[keys] - per_row(presence, 0.0)[rows]


def top_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_top: list[int]):
    """logprobs [L, V] of the rows asking for them; sampled [L] their sampled token ids.

    Returns ({token: logprob} per row with the sampled token first, then the top num_top[i];
    rank of the sampled token per row: 1 + the number of tokens strictly more likely).
    """
    sampled_logprob = logprobs.gather(1, sampled[:, None])  # [L, 1]
    ranks = ((logprobs > sampled_logprob).sum(-1, dtype=torch.int32) + 1).tolist()
    dicts = [{token: value} for token, value
             in zip(sampled.tolist(), sampled_logprob[:, 0].tolist())]
    if max(num_top) > 0:
        top_values, top_ids = logprobs.topk(max(num_top), dim=-1)  # [L, k] each
        for entry, count, ids, values in zip(dicts, num_top, top_ids.tolist(),
                                             top_values.tolist()):
            entry.update(zip(ids[:count], values[:count]))
    return dicts, ranks


def add_logit_bias_(logits: torch.Tensor, row_ids: list[int],
                    biases: list[dict[int, float]]) -> None:
    """logits [B, V], contiguous, modified in place: each row's bias added to its tokens."""
    keys, _ = flat_token_keys(row_ids, [list(bias) for bias in biases], logits.shape[1],
                              logits.device)
    values = torch.tensor([value for bias in biases for value in bias.values()],
                          dtype=logits.dtype, device=logits.device)
    logits.view(-1).index_add_(0, keys, values)


def keep_only_(logits: torch.Tensor, row_ids: list[int], allowed: list[list[int]]) -> None:
    """logits [B, V], contiguous, modified in place: in each row of row_ids every token but
    its allowed ones becomes -inf."""
    keys, _ = flat_token_keys(row_ids, allowed, logits.shape[1], logits.device)
    kept = logits.view(-1)[keys]
    rows = torch.tensor(row_ids, device=logits.device)
    logits.index_fill_(0, rows, float("-inf"))
    logits.view(-1)[keys] = kept
