"""Triton kernel of the speculative rejection rule for model-free drafts (the torch reference
is services/engine/spec/rejection.py; the rule is explained there): one program per verified
position, two passes over the vocabulary (the row's mass, then the inverse-CDF draw of the
token that replaces a refused draft)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton_support import ensure_runnable

BLOCK_V = 1024


@triton.jit
def _rejection_kernel(
    probs_ptr,  # [R, V] float32, unnormalized, >= 0
    draft_ptr,  # [R] int64, -1: no draft
    uniform_ptr,  # [R] float64 in [0, 1)
    out_ptr,  # [R] int64
    probs_stride_row,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * probs_stride_row
    draft = tl.load(draft_ptr + row)
    uniform = tl.load(uniform_ptr + row)
    has_draft = draft >= 0
    total = tl.zeros((), dtype=tl.float64)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        block = tl.load(base + offsets, mask=offsets < vocab_size, other=0.0)
        total += tl.sum(block.to(tl.float64), axis=0)
    draft_mass = tl.load(base + tl.maximum(draft, 0)).to(tl.float64)
    draft_mass = tl.where(has_draft, draft_mass, 0.0)
    draft_prob = draft_mass / total
    accepted = has_draft & (uniform < draft_prob)
    # A refused draft: the rest of the uniform draws from the row without the draft.
    recover = tl.where(has_draft, (uniform - draft_prob) / (1.0 - draft_prob), uniform)
    recover = tl.minimum(tl.maximum(recover, 0.0), 1.0 - 1.1102230246251565e-16)
    target = recover * (total - draft_mass)
    running = tl.zeros((), dtype=tl.float64)
    found = tl.zeros((), dtype=tl.int64) + vocab_size
    last_nonzero = tl.zeros((), dtype=tl.int64) - 1
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        block = tl.load(base + offsets, mask=offsets < vocab_size, other=0.0).to(tl.float64)
        block = tl.where(offsets == draft, 0.0, block)
        cumulative = tl.cumsum(block, axis=0) + running
        hit = (cumulative > target) & (block > 0.0)
        found = tl.minimum(found, tl.min(tl.where(hit, offsets.to(tl.int64), vocab_size), axis=0))
        last_nonzero = tl.maximum(
            last_nonzero, tl.max(tl.where(block > 0.0, offsets.to(tl.int64), -1), axis=0))
        running += tl.sum(block, axis=0)
    # Rounding can leave the target past the last token: it takes the last one of nonzero mass.
    drawn = tl.where(found < vocab_size, found, last_nonzero)
    tl.store(out_ptr + row, tl.where(accepted, draft, drawn))


def rejection_sample_triton(
    probs: torch.Tensor,  # [R, V] float32, unnormalized, >= 0, after truncation
    draft_token_ids: torch.Tensor,  # [R] long, -1: none
    uniforms: torch.Tensor,  # [R] float64 in [0, 1)
) -> torch.Tensor:  # [R] long: the draft where accepted, else the token drawn instead
    ensure_runnable(_rejection_kernel, probs.device)
    num_rows, vocab_size = probs.shape
    out = torch.empty(num_rows, dtype=torch.long, device=probs.device)
    if num_rows == 0:
        return out
    probs = probs.float()
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    _rejection_kernel[(num_rows,)](
        probs, draft_token_ids.long().contiguous(), uniforms.double().contiguous(), out,
        probs.stride(0), vocab_size, BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab_size)))
    return out
