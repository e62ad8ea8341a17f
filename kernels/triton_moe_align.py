"""Lays out the (token, slot) pairs of a mixture-of-experts step for the grouped Triton GEMMs:
sorted by expert, each expert's rows padded to a whole number of row blocks, so that every
block of rows belongs to one expert. Torch ops only, and no host sync: the grid is sized for
the worst case and the blocks past the end are marked (expert id E) for the kernels to skip."""
from __future__ import annotations

import torch


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int64 in [0, E) -> (sorted_pairs [num_blocks * block_m] int32,
    block_experts [num_blocks] int32). Pair p is token p // k, slot p % k; padding rows hold
    T * k, blocks past the last expert's hold E."""
    flat_ids = topk_ids.reshape(-1)  # [P]
    num_pairs = flat_ids.numel()
    device = flat_ids.device
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # [P] each
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    destination = (padded_end - padded)[sorted_ids] + rank  # [P]
    # at most min(E, P) experts are active, each adding under block_m rows of padding
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1) + block_m - 1) // block_m
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[destination] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts
