"""Sampler tests: every check compares with a hand-computed value or a float64 reference."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.engine.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from kvrelay.engine.sampling_draw import sample_from_probs, truncation_cutoffs
from kvrelay.engine.sampling_ops import apply_penalties_
from kvrelay.engine.sampling_params import SamplingParams


def make_row(prompt=(), output=(), banned=(), child_index=0, **params) -> SamplingRow:
    sampling = SamplingParams(**params)
    generator = None if sampling.seed is None else make_generator(sampling.seed, child_index)
    return SamplingRow(sampling, list(prompt), list(output), generator, list(banned))


def reference_penalized(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """logits [V] float64 after bans and penalties, one token at a time."""
    out = logits.astype(np.float64).copy()
    out[list(row.banned_token_ids)] = -np.inf
    p = row.params
    for token in set(row.prompt_token_ids) | set(row.output_token_ids):
        if p.repetition_penalty != 1.0:
            out[token] = (out[token] / p.repetition_penalty if out[token] > 0
                          else out[token] * p.repetition_penalty)
    for token, count in Counter(row.output_token_ids).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """[V] float64 distribution after temperature, top-k, top-p, min-p (ties at a cut kept)."""
    scaled = logits / p.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    if 0 < p.top_k < len(probs):
        keep &= probs >= np.sort(probs)[::-1][p.top_k - 1]
    if p.top_p < 1.0:
        kept = np.where(keep, probs, 0.0)
        ordered = np.sort(kept)[::-1] / kept.sum()
        before = np.cumsum(ordered) - ordered
        num_nucleus = int((before < p.top_p).sum())
        keep &= kept / kept.sum() >= ordered[num_nucleus - 1]
    keep &= probs >= p.min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, rows: list[SamplingRow], sampler=None) -> SamplerOutput:
    return (sampler or Sampler())(logits, rows)


# ---------------------------------------------------------------- greedy and bans


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    logits[2, [7, 40, 99]] = 50.0  # a three-way tie
    rows = [make_row(temperature=0.0) for _ in range(6)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()
    assert sample(logits, rows).token_ids[2] == 7
    # Off the fast path (a row asks for logprobs) greedy rows give the same answer.
    rows[0] = make_row(temperature=0.0, logprobs=2)
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_bf16_logits_are_accepted():
    torch.manual_seed(1)
    logits = torch.randn(4, 300).bfloat16()
    greedy = sample(logits, [make_row(temperature=0.0) for _ in range(4)]).token_ids
    assert greedy == logits.float().argmax(-1).tolist()
    out = sample(logits, [make_row(temperature=0.8, top_p=0.9, logprobs=1) for _ in range(4)])
    assert all(0 <= t < 300 for t in out.token_ids)


def test_input_logits_are_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    before = logits.clone()
    rows = [make_row(temperature=0.7, top_k=5, banned=[1, 2], output=[3, 3],
                     frequency_penalty=1.0, repetition_penalty=1.5),
            make_row(temperature=1.0, top_p=0.5, min_p=0.1, logprobs=3),
            make_row(temperature=0.0, banned=[int(logits[2].argmax())])]
    sample(logits, rows)
    assert torch.equal(logits, before)
    sample(logits, [make_row(temperature=1.0) for _ in range(3)])
    assert torch.equal(logits, before)


def test_banned_tokens_are_never_chosen():
    torch.manual_seed(3)
    logits = torch.randn(1, 20) * 3
    order = logits[0].argsort(descending=True).tolist()
    greedy = sample(logits, [make_row(temperature=0.0, banned=order[:2])]).token_ids
    assert greedy == [order[2]]
    # 2000 draws with the five likeliest tokens banned, under several truncations.
    banned = order[:5]
    variants = [dict(temperature=1.0), dict(temperature=2.0, top_k=3),
                dict(temperature=1.0, top_p=0.3), dict(temperature=1.0, min_p=0.5)]
    rows = [make_row(banned=banned, **variants[i % 4]) for i in range(2000)]
    tokens = sample(logits.expand(2000, -1), rows).token_ids
    assert not set(tokens) & set(banned)
    assert len(set(tokens)) > 3


# ---------------------------------------------------------------- penalties


def _penalized(logits: list[float], **kwargs) -> list[float]:
    tensor = torch.tensor([logits])
    apply_penalties_(tensor, [0], prompts=[kwargs.get("prompt", [])],
                     outputs=[kwargs.get("output", [])],
                     repetition=[kwargs.get("repetition", 1.0)],
                     frequency=[kwargs.get("frequency", 0.0)],
                     presence=[kwargs.get("presence", 0.0)])
    return tensor[0].tolist()


HAND_LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
HAND_PROMPT, HAND_OUTPUT = [0, 1, 2, 0], [2, 2, 4]  # repeats, and 2 in both


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    got = _penalized(HAND_LOGITS, prompt=HAND_PROMPT, output=HAND_OUTPUT, repetition=2.0)
    assert got == pytest.approx([1.0, -2.0, 0.25, 3.0, -4.0, 0.0])


def test_frequency_penalty_subtracts_count_in_output_only():
    got = _penalized(HAND_LOGITS, prompt=HAND_PROMPT, output=HAND_OUTPUT, frequency=0.5)
    assert got == pytest.approx([2.0, -1.0, -0.5, 3.0, -2.5, 0.0])


def test_presence_penalty_subtracts_once_per_token_in_output():
    got = _penalized(HAND_LOGITS, prompt=HAND_PROMPT, output=HAND_OUTPUT, presence=0.25)
    assert got == pytest.approx([2.0, -1.0, 0.25, 3.0, -2.25, 0.0])


def test_penalties_compose_repetition_then_frequency_then_presence():
    got = _penalized(HAND_LOGITS, prompt=HAND_PROMPT, output=HAND_OUTPUT,
                     repetition=2.0, frequency=0.5, presence=0.25)
    assert got == pytest.approx([1.0, -2.0, -1.0, 3.0, -4.75, 0.0])
    # Negative penalties reward instead.
    got = _penalized(HAND_LOGITS, output=[3], frequency=-1.0, presence=-0.5)
    assert got == pytest.approx([2.0, -1.0, 0.5, 4.5, -2.0, 0.0])


def test_penalties_touch_only_their_own_rows():
    logits = torch.tensor([HAND_LOGITS] * 3)
    apply_penalties_(logits, [0, 2], prompts=[HAND_PROMPT, [5]], outputs=[HAND_OUTPUT, [1, 1]],
                     repetition=[2.0, 1.0], frequency=[0.0, 1.0], presence=[0.25, 0.0])
    assert logits[0].tolist() == pytest.approx([1.0, -2.0, 0.0, 3.0, -4.25, 0.0])
    assert logits[1].tolist() == HAND_LOGITS
    assert logits[2].tolist() == pytest.approx([2.0, -3.0, 0.5, 3.0, -2.0, 0.0])


def test_penalties_steer_greedy_choices():
    logits = torch.tensor([[3.0, 2.0, 1.0]] * 3)
    rows = [make_row(temperature=0.0, output=[0], repetition_penalty=2.0),  # 1.5 < 2
            make_row(temperature=0.0, output=[0], presence_penalty=1.5),  # 1.5 < 2
            make_row(temperature=0.0, prompt=[1], output=[0], frequency_penalty=0.5)]  # 2.5
    assert sample(logits, rows).token_ids == [1, 1, 0]


def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 10), [make_row(output=[10], frequency_penalty=1.0)])
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 10), [make_row(banned=[-1])])
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [make_row()])


def test_empty_batch():
    assert sample(torch.zeros(0, 10), []) == SamplerOutput([], [], [])


# ---------------------------------------------------------------- seeds


def _target_rows() -> list[SamplingRow]:
    return [make_row(seed=1234, temperature=0.9, top_p=0.9),
            make_row(seed=99, temperature=1.3, top_k=40, min_p=0.01, frequency_penalty=0.3)]


def _neighbours(rng: torch.Generator, count: int) -> list[SamplingRow]:
    kinds = [dict(seed=7), dict(), dict(temperature=0.0), dict(top_k=5, seed=8),
             dict(top_p=0.5), dict(temperature=0.5, min_p=0.2, logprobs=2),
             dict(top_k=300, top_p=0.95)]  # more top-k candidates than a nucleus gets
    picks = torch.randint(len(kinds), (count,), generator=rng).tolist()
    return [make_row(**kinds[k]) for k in picks]


@pytest.mark.parametrize("layout", ["alone", "first", "last", "middle"])
def test_seeded_rows_ignore_the_rest_of_the_batch(layout):
    vocab = 1000
    steps = 5
    expected = _seeded_run(vocab, steps, "alone")
    got = _seeded_run(vocab, steps, layout)
    assert got == expected
    assert len({tokens for tokens, _ in expected[0]}) > 1  # the rows really are random


def _seeded_run(vocab: int, steps: int, layout: str):
    """Returns per target row the list of (token, generator state) over the steps."""
    targets = _target_rows()
    history = [[] for _ in targets]
    sampler = Sampler()  # one across steps, as in the engine: its scratch buffers get reused
    batch_rng = torch.Generator().manual_seed(len(layout))
    for step in range(steps):
        target_logits = torch.randn(len(targets), vocab,
                                    generator=torch.Generator().manual_seed(step)) * 3
        others = {"alone": 0, "first": 5, "last": 7, "middle": 9}[layout]
        other_rows = _neighbours(batch_rng, others)
        other_logits = torch.randn(others, vocab, generator=batch_rng) * 3
        if layout == "first":
            rows, logits = targets + other_rows, torch.cat([target_logits, other_logits])
            where = [0, 1]
        elif layout == "last":
            rows, logits = other_rows + targets, torch.cat([other_logits, target_logits])
            where = [others, others + 1]
        elif layout == "middle":
            rows = other_rows[:3] + targets[:1] + other_rows[3:6] + targets[1:] + other_rows[6:]
            logits = torch.cat([other_logits[:3], target_logits[:1], other_logits[3:6],
                                target_logits[1:], other_logits[6:]])
            where = [3, 7]
        else:
            rows, logits, where = list(targets), target_logits, [0, 1]
        tokens = sampler(logits, rows).token_ids
        for i, (target, index) in enumerate(zip(targets, where)):
            target.output_token_ids.append(tokens[index])
            history[i].append((tokens[index], bytes(target.generator.get_state().numpy())))
    return history


def test_same_seed_repeats_and_other_seeds_differ():
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(5))

    def run(seed, child_index=0):
        row = make_row(seed=seed, child_index=child_index)
        return [Sampler()(logits, [row]).token_ids[0] for _ in range(6)]

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert run(3, child_index=1) == run(3, child_index=1)
    assert run(3, child_index=1) != run(3)
    assert run(3, child_index=1) != run(4, child_index=0)  # not merely seed + index


def test_make_generator_streams():
    def first_draws(seed, child):
        return torch.rand(4, generator=make_generator(seed, child)).tolist()

    assert first_draws(11, 0) == torch.rand(4, generator=torch.Generator().manual_seed(11)).tolist()
    children = [tuple(first_draws(11, i)) for i in range(8)]
    assert len(set(children)) == 8
    assert first_draws(11, 3) == first_draws(11, 3)
    assert make_generator(-5, 0).device.type == "cpu"  # negative seeds are fine


# ---------------------------------------------------------------- truncation


def test_truncation_hand_examples():
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]])
    cases = [(dict(top_p=0.4), {0}), (dict(top_p=0.75), {0, 1}), (dict(top_p=0.85), {0, 1, 2}),
             (dict(top_k=2), {0, 1}), (dict(top_k=1, temperature=5.0), {0}),
             (dict(min_p=0.35), {0, 1}), (dict(min_p=0.25), {0, 1, 2}),
             (dict(top_p=0.83), {0, 1, 2}),
             (dict(top_k=3, top_p=0.83), {0, 1}),  # top-p over the renormalized top 3
             (dict(top_p=0.95, min_p=0.2), {0, 1, 2})]
    for params, allowed in cases:
        rows = [make_row(**params) for _ in range(500)]
        drawn = set(sample(logits.expand(500, -1), rows).token_ids)
        assert drawn == allowed, params


TRUNCATIONS = [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.1), dict(top_k=10, top_p=0.8),
               dict(temperature=0.7, top_p=0.9, min_p=0.05), dict(temperature=1.5, top_k=30),
               dict(temperature=1.0)]


@pytest.mark.parametrize("candidates", [256, 3])
def test_truncation_keeps_draws_inside_the_allowed_set(candidates):
    vocab, draws = 200, 2000
    generator = torch.Generator().manual_seed(candidates)
    distinct = torch.randn(len(TRUNCATIONS), vocab, generator=generator) * 2.5
    which = [i % len(TRUNCATIONS) for i in range(draws * len(TRUNCATIONS))]
    rows = [make_row(**TRUNCATIONS[i]) for i in which]
    torch.manual_seed(candidates)
    tokens = Sampler(num_nucleus_candidates=candidates)(distinct[which], rows).token_ids
    for i, params in enumerate(TRUNCATIONS):
        probs = reference_probs(distinct[i].double().numpy(), rows[i].params)
        drawn = Counter(t for t, w in zip(tokens, which) if w == i)
        assert all(probs[t] > 0 for t in drawn), params
        likely = {t for t in np.nonzero(probs > 0.01)[0].tolist()}
        assert likely <= set(drawn), params  # the allowed set is reached, not just one token
        assert len(drawn) > 1


def test_wide_nucleus_with_few_candidates_matches_the_reference():
    # A near-flat row: the nucleus holds hundreds of tokens, far past 4 candidates.
    vocab, draws = 300, 2000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 0.3
    params = dict(top_p=0.9)
    rows = [make_row(**params) for _ in range(draws)]
    torch.manual_seed(9)
    tokens = Sampler(num_nucleus_candidates=4)(logits.expand(draws, -1), rows).token_ids
    probs = reference_probs(logits[0].double().numpy(), rows[0].params)
    assert all(probs[t] > 0 for t in tokens)
    assert 200 < int((probs > 0).sum()) < vocab
    assert len(set(tokens)) > 150


def _reference_cutoff(probs: np.ndarray, top_k: int, top_p: float) -> float:
    """probs [V] float64, unnormalized: the smallest kept probability (ties at it are kept)."""
    ordered = np.sort(probs)[::-1]
    if top_k:
        ordered = ordered[:top_k]
    before = np.cumsum(ordered) - ordered
    return ordered[int((before < top_p * ordered.sum()).sum()) - 1]


def test_nucleus_cutoffs_match_the_reference_on_a_large_vocabulary():
    vocab = 20000
    generator = torch.Generator().manual_seed(31)
    logits = torch.stack([
        torch.randn(vocab, generator=generator) * 0.5,  # flat: nucleus of thousands
        torch.randn(vocab, generator=generator) * 2.0,
        torch.randn(vocab, generator=generator).mul(3).round(),  # many exact ties
        torch.randn(vocab, generator=generator) * 4.0,  # peaked: fits the candidates
        torch.randn(vocab, generator=generator) * 1.0,
        torch.randn(vocab, generator=generator) * 1.5])
    top_k = torch.tensor([0, 0, 0, 0, 3000, 0])
    top_p = torch.tensor([0.9, 0.95, 0.8, 0.5, 0.9, 0.999], dtype=torch.float64)
    probs = (logits - logits.amax(-1, keepdim=True)).exp()
    cutoff = truncation_cutoffs(probs, top_k, top_p, torch.zeros(6), num_candidates=16)
    for i in range(6):
        row = probs[i].double().numpy()
        expected = _reference_cutoff(row, int(top_k[i]), float(top_p[i]))
        kept, expected_kept = row >= float(cutoff[i]), row >= expected
        assert (kept == expected_kept).all(), (i, int(kept.sum()), int(expected_kept.sum()))
        assert 1 < kept.sum() < vocab


def test_draws_cross_block_edges_and_skip_zero_tokens():
    for vocab, support in [(600, [0, 255, 256, 511, 599]), (100, [3, 99]), (512, [511])]:
        weights = torch.zeros(vocab)
        weights[support] = torch.arange(1, len(support) + 1, dtype=torch.float32)
        torch.manual_seed(vocab)
        draws = 4000
        tokens = sample_from_probs(weights.expand(draws, -1).contiguous(),
                                   torch.rand(draws, dtype=torch.float64))
        counts = torch.bincount(tokens, minlength=vocab)
        assert set(torch.nonzero(counts).squeeze(1).tolist()) == set(support)
        expected = weights[support] / weights.sum()
        assert (counts[support] / draws - expected).abs().max() < 0.03


def test_a_rounding_overshoot_at_a_block_end_still_draws_a_possible_token():
    # The float32 block sum 1 + 0.6 ulp rounds up to 1 + 1 ulp, past the exact float64 sum
    # within the block; a target in that gap must not run on into the zero tokens after it.
    ulp = 2.0 ** -23
    probs = torch.zeros(1, 256)
    probs[0, 0], probs[0, 1] = 1.0, 0.6 * ulp
    uniform = torch.tensor([(1 + 0.8 * ulp) / (1 + ulp)], dtype=torch.float64)
    assert sample_from_probs(probs, uniform).tolist() == [1]


# ---------------------------------------------------------------- distribution


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.5),
                                    dict(temperature=1.0, top_k=3), dict(temperature=2.0,
                                                                          top_p=0.7)])
def test_draws_follow_the_softmax(params):
    draws = 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5]])
    rows = [make_row(**params) for _ in range(draws)]
    torch.manual_seed(17)
    tokens = sample(logits.expand(draws, -1), rows).token_ids
    frequencies = np.bincount(tokens, minlength=8) / draws
    expected = reference_probs(logits[0].double().numpy(), rows[0].params)
    assert np.abs(frequencies - expected).max() < 0.02, (frequencies, expected)


def test_seeded_draws_follow_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    generator = make_generator(2024)
    row = SamplingRow(SamplingParams(temperature=1.0, seed=2024), [], [], generator, [])
    tokens = [Sampler()(logits, [row]).token_ids[0] for _ in range(3000)]
    frequencies = np.bincount(tokens, minlength=4) / len(tokens)
    expected = reference_probs(logits[0].double().numpy(), row.params)
    assert np.abs(frequencies - expected).max() < 0.04


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits_with_sampled_token_and_rank():
    torch.manual_seed(21)
    logits = torch.randn(5, 64) * 2
    raw = torch.log_softmax(logits.double(), -1)
    rows = [make_row(temperature=0.0, logprobs=3),
            make_row(temperature=0.7, top_k=20, logprobs=5, output=[1, 2],
                     repetition_penalty=1.7, presence_penalty=1.0, banned=[7]),
            make_row(temperature=1.0),
            make_row(temperature=1.3, logprobs=0, seed=5),
            make_row(temperature=0.0, banned=[int(logits[4].argmax())], logprobs=1)]
    out = sample(logits, rows)
    assert out.logprobs[2] is None and out.ranks[2] is None
    for i, row in enumerate(rows):
        if row.params.logprobs is None:
            continue
        token, entry = out.token_ids[i], out.logprobs[i]
        assert next(iter(entry)) == token  # the sampled token comes first
        top = raw[i].topk(row.params.logprobs).indices.tolist()
        assert set(entry) == {token, *top}
        for t, value in entry.items():
            assert value == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert out.ranks[i] == 1 + int((raw[i] > raw[i, token]).sum())
    assert out.ranks[0] == 1
    assert out.ranks[4] == 2  # greedy under a ban of the raw argmax


# ---------------------------------------------------------------- property


ROW_PARAMS = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    "top_k": st.integers(0, 12),
    "top_p": st.floats(0.05, 1.0),
    "min_p": st.floats(0.0, 0.6),
    "seed": st.integers(0, 2**40),
    "repetition_penalty": st.sampled_from([1.0, 0.8, 1.3]),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "logprobs": st.sampled_from([None, 0, 2]),
})


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(3, 40), data=st.data(),
       row_specs=st.lists(st.tuples(ROW_PARAMS, st.integers(0, 2**31)), min_size=1, max_size=6))
def test_every_row_obeys_the_reference(vocab, data, row_specs):
    rows, logits = [], []
    for params, seed in row_specs:
        rng = np.random.default_rng(seed)
        tokens = st.lists(st.integers(0, vocab - 1), max_size=6)
        row = make_row(prompt=data.draw(tokens), output=data.draw(tokens),
                       banned=rng.choice(vocab, size=min(2, vocab - 1), replace=False).tolist(),
                       **params)
        rows.append(row)
        logits.append(rng.normal(0, 2, vocab))
    batch = torch.tensor(np.array(logits), dtype=torch.float32)
    out = Sampler(num_nucleus_candidates=4)(batch, rows)
    for i, row in enumerate(rows):
        penalized = reference_penalized(batch[i].double().numpy(), row)
        token = out.token_ids[i]
        assert token not in row.banned_token_ids
        if row.params.temperature == 0.0:
            assert penalized[token] == pytest.approx(penalized.max(), abs=1e-4)
        else:
            # The sampler works in float32, so a token right at a cut may go either way.
            allowed = reference_probs(penalized, row.params)[token] > 0
            assert allowed or _at_cut_edge(penalized, row.params, token)
        if row.params.logprobs is None:
            assert out.logprobs[i] is None
        else:
            raw = torch.log_softmax(batch[i].double(), -1)
            assert out.logprobs[i][token] == pytest.approx(raw[token].item(), abs=1e-5)


def _at_cut_edge(logits: np.ndarray, params: SamplingParams, token: int) -> bool:
    """Whether a small nudge of the truncation parameters would allow the token."""
    loose = SamplingParams(temperature=params.temperature, top_k=params.top_k,
                           top_p=min(1.0, params.top_p + 1e-4), min_p=params.min_p * (1 - 1e-4))
    return reference_probs(logits, loose)[token] > 0
