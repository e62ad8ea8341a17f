"""The random-sampling path of verification is distribution-exact: over many seeded draws on
small synthetic logits, the first and later emitted tokens follow the target distribution
(a chi-square test at a fixed significance), and the same test fails for rules broken on
purpose."""
from __future__ import annotations

import torch

from kvrelay.engine.request import Request
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.sampling_draw import sample_from_probs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.engine.spec.rejection import rejection_sample
from kvrelay.engine.spec.verify import sample_items

VOCAB = 8
# chi-square critical values at significance 0.001, by degrees of freedom
CRITICAL = {5: 20.52, 6: 22.46, 7: 24.32}
NUM_DRAWS = 40_000


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the tokens' counts against probs (zero-probability tokens must
    not occur at all: they make it infinite)."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    if bool((counts[expected == 0] > 0).any()):
        return float("inf")
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _degrees(probs: torch.Tensor) -> int:
    return int((probs > 0).sum()) - 1


def _target() -> torch.Tensor:
    return torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])


def _draw(rule, draft: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    probs = _target().repeat(NUM_DRAWS, 1)
    drafts = torch.full((NUM_DRAWS,), draft, dtype=torch.long)
    uniforms = torch.rand(NUM_DRAWS, generator=generator, dtype=torch.float64)
    return rule(probs, drafts, uniforms)


def _recover_without_removing(probs, drafts, uniforms):
    """Broken: a refused draft is drawn again from the whole target, draft included."""
    prob = probs.gather(1, drafts[:, None]).squeeze(1).double() / probs.sum(-1).double()
    fresh = torch.rand(len(uniforms), dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))
    return torch.where(uniforms < prob, drafts, sample_from_probs(probs, fresh))


def _accept_too_often(probs, drafts, uniforms):
    """Broken: the acceptance probability is sqrt(p(d)) instead of p(d)."""
    prob = probs.gather(1, drafts[:, None]).squeeze(1).double() / probs.sum(-1).double()
    accepted = uniforms < prob.sqrt()
    refused = ~accepted
    out = rejection_sample(probs, drafts, torch.where(refused, torch.maximum(
        uniforms, prob + 1e-12).clamp(max=1 - 1e-12), uniforms))
    return torch.where(accepted, drafts, out)


def test_the_rule_keeps_the_target_distribution_for_every_draft():
    target = _target()
    for draft in range(VOCAB):  # likely, unlikely and zero-probability drafts
        tokens = _draw(rejection_sample, draft, seed=100 + draft)
        assert chi_square(tokens, target) < CRITICAL[_degrees(target)], draft


def test_the_test_catches_broken_rules():
    target = _target()
    for rule in (_recover_without_removing, _accept_too_often):
        tokens = _draw(rule, draft=2, seed=7)
        assert chi_square(tokens, target) > CRITICAL[_degrees(target)], rule.__name__


def _processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    probs = torch.softmax(logits.double() / temperature, -1)
    cutoff = probs.topk(top_k).values[-1]
    probs = torch.where(probs >= cutoff, probs, 0.0)
    return probs / probs.sum()


def test_first_and_later_emitted_tokens_follow_the_target_through_the_sampler():
    torch.manual_seed(1234)  # unseeded rows draw from the default generator
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=100)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5, -0.5, 0.3],
                           [0.1, 1.2, -0.3, 0.9, 2.2, -1.0, 0.4, 0.0]])  # [2, V]
    drafts = [5, 4]  # verified after the last token, then after the first draft
    request = Request("r", [1, 2, 3], params)
    sampler, batch = Sampler(), 2_000
    first, second, third = [], [], []
    third_logits = torch.tensor([1.0, -2.0, 0.5, 0.5, 0.0, 1.0, 2.0, -1.0])
    step_logits = torch.cat([logits, third_logits[None]]).repeat(batch, 1)  # [3 * batch, V]
    items = [ScheduledRequest(request, 3, [], drafts) for _ in range(batch)]
    for _ in range(NUM_DRAWS // batch):
        for run in sample_items(sampler, step_logits, items, [None] * batch):
            first.append(run.token_ids[0])
            if len(run.token_ids) > 1:
                second.append(run.token_ids[1])
            if len(run.token_ids) > 2:
                third.append(run.token_ids[2])
    for tokens, row_logits in ((first, logits[0]), (second, logits[1]), (third, third_logits)):
        target = _processed(row_logits, 0.8, 6)
        assert len(tokens) > 2_000
        assert chi_square(torch.tensor(tokens), target) < CRITICAL[_degrees(target)]
