"""Truncation (top-k, top-p, min-p) and the inverse-CDF draw, batched over rows.

Both work on unnormalized probabilities `exp(x - max x)`, so a row's maximum is exactly 1, and
neither sorts the vocabulary: top-k and most nuclei come from one `topk` of a few hundred
candidates; a nucleus wider than that is found with a histogram over the float bits of the
probabilities (whose integer order is their numeric order); the draw walks 256-token blocks.
"""
from __future__ import annotations

import torch

NUM_NUCLEUS_CANDIDATES = 256  # first guess at a nucleus; most of a real model's fit in it
DRAW_BLOCK = 256  # tokens per block of the two-level inverse CDF
# Buckets of the nucleus histogram: float32 bits >> 16 keep the exponent and 7 mantissa bits,
# so a bucket spans a factor of at most 1 + 1/128 and probabilities in (0, 1] need 16257.
_BUCKET_SHIFT = 16
_NUM_BUCKETS = (0x3F800000 >> _BUCKET_SHIFT) + 1  # up to the bits of 1.0


def truncation_cutoffs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor,
                       num_candidates: int = NUM_NUCLEUS_CANDIDATES) -> torch.Tensor:
    """Per row, the probability below which top-k, then top-p, then min-p drop a token.

    probs [R, V] contiguous, unnormalized, each row's maximum exactly 1. top_k [R] long
    (0 = off), top_p [R] float64 (1 = off), min_p [R] float32 (0 = off).
    Returns cutoff [R] float32: keep the tokens with probs >= cutoff. Every filter keeps an
    upper set of the probabilities, so the three compose as the largest of their cutoffs, and
    ties at a cutoff are all kept. min-p compares with the maximum, which truncation keeps, so
    it needs no renormalization: prob < min_p * max  <=>  probs < min_p.
    """
    num_rows, vocab_size = probs.shape
    cutoff = min_p.to(probs.dtype).clone()
    top_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, 0)
    need_rows = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1)
    if need_rows.numel() == 0:
        return cutoff
    top_k, top_p = top_k[need_rows], top_p[need_rows]
    rows = probs if need_rows.numel() == num_rows else probs.index_select(0, need_rows)
    num_kept = torch.where(top_k > 0, top_k, vocab_size)  # [N] tokens top-k keeps
    row_sums = torch.zeros(len(need_rows), dtype=torch.float64, device=probs.device)  # [N]
    if bool((top_k == 0).any()):
        row_sums = block_sums(rows).sum(-1, dtype=torch.float64)
    # One topk serves every top-k row and every nucleus of up to num_candidates tokens.
    budget = min(num_candidates, vocab_size)
    num_wanted = torch.where(top_k > 0, top_k, budget)
    candidates = rows.topk(int(num_wanted.max()), dim=-1).values  # [N, K] descending
    row_cutoff, done = _cutoff_from_candidates(candidates, num_kept, top_p, row_sums, budget)
    wide = (~done).nonzero().squeeze(1)
    if wide.numel():
        wide_rows = rows if wide.numel() == len(rows) else rows.index_select(0, wide)
        row_cutoff[wide] = _wide_nucleus_cutoff(wide_rows, top_p[wide], row_sums[wide])
    cutoff[need_rows] = torch.maximum(cutoff[need_rows], row_cutoff)
    return cutoff


def _cutoff_from_candidates(candidates: torch.Tensor, num_kept: torch.Tensor,
                            top_p: torch.Tensor, row_sums: torch.Tensor, budget: int):
    """candidates [N, K] descending probs; num_kept [N] top-k size (V when off); top_p [N];
    row_sums [N] float64, the full row's sum where top-k is off.

    Returns (cutoff [N], done [N] bool). A row without top-k is done when its nucleus fits in
    `budget` candidates, even if K is larger for another row's sake: whether a row takes the
    histogram path must not depend on the rest of the batch.
    """
    num_cand = candidates.shape[1]
    position = torch.arange(num_cand, device=candidates.device)
    in_top_k = position < num_kept[:, None]  # [N, K]
    top_k_cutoff = candidates.gather(1, (num_kept.clamp(max=num_cand) - 1)[:, None]).squeeze(1)
    probs = candidates.to(torch.float64).masked_fill(~in_top_k, 0.0)
    cumulative = probs.cumsum(-1)
    total = torch.where(num_kept <= num_cand, cumulative[:, -1], row_sums)
    # A token is in the nucleus when the tokens before it sum to less than top_p.
    before = cumulative - probs
    in_nucleus = (before < top_p[:, None] * total[:, None]) & in_top_k
    num_nucleus = in_nucleus.sum(-1)  # >= 1: the first token has nothing before it
    nucleus_cutoff = candidates.gather(1, (num_nucleus - 1)[:, None]).squeeze(1)
    nucleus_cutoff = torch.where(top_p < 1.0, nucleus_cutoff, 0.0)
    done = (num_kept <= num_cand) | (num_nucleus < budget)
    return torch.maximum(top_k_cutoff, nucleus_cutoff), done


def _wide_nucleus_cutoff(probs: torch.Tensor, top_p: torch.Tensor,
                         row_sums: torch.Tensor) -> torch.Tensor:
    """Top-p cutoff [W] of rows probs [W, V] (contiguous) without sorting them.

    A histogram of probability mass over bucketed float bits (radix select) finds the bucket
    where the descending cumulative mass reaches top_p; only that bucket's few tokens are then
    ordered. Bucket masses are float32 sums, as precise as a float32 cumulative sum (vLLM's).
    """
    num_rows = probs.shape[0]
    row_base = torch.arange(num_rows, dtype=torch.int32, device=probs.device) * _NUM_BUCKETS
    keys = probs.view(torch.int32) >> _BUCKET_SHIFT  # [W, V] bucket of each token
    keys += row_base[:, None]
    mass = torch.bincount(keys.view(-1), weights=probs.view(-1), minlength=num_rows * _NUM_BUCKETS)
    descending = mass.view(num_rows, _NUM_BUCKETS).flip(-1).to(torch.float64).cumsum(-1)
    target = top_p * row_sums  # [W]
    # Buckets whose mass, with all above them, stays under the target are wholly in the
    # nucleus; the next one holds its boundary.
    num_above = (descending < target[:, None]).sum(-1).clamp_(max=_NUM_BUCKETS - 1)  # [W]
    above = descending.gather(1, (num_above - 1).clamp(min=0)[:, None]).squeeze(1)
    above = torch.where(num_above > 0, above, 0.0)
    boundary = row_base + (_NUM_BUCKETS - 1 - num_above).to(torch.int32)  # [W]
    in_boundary = keys == boundary[:, None]  # [W, V]
    num_in_boundary = in_boundary.sum(-1, dtype=torch.int32)
    num_cand = max(1, int(num_in_boundary.max()))  # 0 only if rounding put the target past all
    values = torch.where(in_boundary, probs, 0.0).topk(num_cand, dim=-1).values
    values64 = values.to(torch.float64)  # [W, C] descending
    before = above[:, None] + values64.cumsum(-1) - values64
    position = torch.arange(values.shape[1], device=probs.device)
    in_nucleus = (before < target[:, None]) & (position < num_in_boundary[:, None])
    num_nucleus = in_nucleus.sum(-1).clamp_(min=1)
    return values.gather(1, (num_nucleus - 1)[:, None]).squeeze(1)


def block_sums(probs: torch.Tensor) -> torch.Tensor:
    """probs [R, V] -> [R, ceil(V / DRAW_BLOCK)] float32 sums of consecutive tokens."""
    num_rows, vocab_size = probs.shape
    num_full = vocab_size // DRAW_BLOCK
    parts = []
    if num_full:
        full = probs[:, :num_full * DRAW_BLOCK].view(num_rows, num_full, DRAW_BLOCK)
        parts.append(full.sum(-1))
    if vocab_size % DRAW_BLOCK:
        parts.append(probs[:, num_full * DRAW_BLOCK:].sum(-1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row, in two levels: block, then token in the block.

    probs [R, V] unnormalized, >= 0, positive somewhere; uniforms [R] float64 in [0, 1).
    Returns tokens [R] long. Sums run along each row alone, so a row's token depends only on
    its own probs and its own uniform; a token of probability zero is never drawn.
    """
    vocab_size = probs.shape[1]
    cdf = block_sums(probs).to(torch.float64).cumsum(-1)  # [R, NB]
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    start = cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)  # [R, 1]
    position = torch.arange(DRAW_BLOCK, device=probs.device)
    tokens = block * DRAW_BLOCK + position  # [R, DRAW_BLOCK]
    values = probs.gather(1, tokens.clamp(max=vocab_size - 1)).to(torch.float64)
    values.masked_fill_(tokens >= vocab_size, 0.0)
    offset = torch.searchsorted(values.cumsum(-1), target[:, None] - start, right=True)
    # Float32 block sums and float64 sums within a block can disagree in the last bits; a
    # target past the block's end falls back to its last token of nonzero probability.
    last_nonzero = torch.where(values > 0, position, -1).amax(-1, keepdim=True)
    offset = torch.minimum(offset, last_nonzero)
    return (block * DRAW_BLOCK + offset).squeeze(1).clamp_(0, vocab_size - 1)
