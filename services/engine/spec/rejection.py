"""The rejection rule for model-free drafts, per verified position (torch reference; the
Triton kernel in kernels/triton_rejection.py computes the same on CUDA).

A model-free draft is a point mass q = 1 at its token d. The rule that keeps the emitted token
distributed exactly as the target p is: accept d with probability min(1, p(d) / q(d)) = p(d);
otherwise sample from max(p - q, 0), normalized, which is p with d removed. One uniform u per
position does both: accept iff u < p(d), else (u - p(d)) / (1 - p(d)) is again uniform and
draws the recovered token by inverse CDF. A position without a draft (the one after the last)
draws from p with u. The emitted token equals the draft iff the draft was accepted.
"""
from __future__ import annotations

import torch

from kvrelay.engine.sampling_draw import sample_from_probs


def rejection_sample(
    probs: torch.Tensor,  # [R, V] target probabilities, unnormalized, >= 0, after truncation
    draft_token_ids: torch.Tensor,  # [R] long, the draft the row verifies; -1: none
    uniforms: torch.Tensor,  # [R] float64 in [0, 1)
) -> torch.Tensor:  # [R] long, the draft where accepted, else the token drawn instead
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0)[:, None]  # [R, 1]
    total = probs.sum(-1, dtype=torch.float64)  # [R]
    draft_prob = probs.gather(1, drafts).squeeze(1).to(torch.float64) / total  # [R]
    draft_prob = torch.where(has_draft, draft_prob, 0.0)
    accepted = has_draft & (uniforms < draft_prob)
    # Rows where a draft was refused draw again without it; p(d) < 1 there since u < 1.
    recover = uniforms.clone()
    refused = has_draft & ~accepted
    recover[refused] = ((uniforms[refused] - draft_prob[refused])
                        / (1.0 - draft_prob[refused])).clamp_(0.0, 1.0 - 2.0 ** -53)
    without_draft = probs.clone()
    without_draft.scatter_(1, drafts, torch.where(refused[:, None], 0.0,
                                                  probs.gather(1, drafts)))
    drawn = sample_from_probs(without_draft, recover)
    return torch.where(accepted, draft_token_ids, drawn)


def rejection_sample_any(probs: torch.Tensor, draft_token_ids: torch.Tensor,
                         uniforms: torch.Tensor) -> torch.Tensor:
    """The Triton kernel for CUDA tensors, the reference elsewhere."""
    if probs.is_cuda:
        from kvrelay.kernels.triton_rejection import rejection_sample_triton

        return rejection_sample_triton(probs, draft_token_ids, uniforms)
    return rejection_sample(probs, draft_token_ids, uniforms)
