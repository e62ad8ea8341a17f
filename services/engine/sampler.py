"""The sampler: one row of logits per sequence in, one token per sequence out.

Order, as vLLM and HF users expect: output constraints (the grammar's bitmask, allowed_token_ids,
logit_bias) -> bans -> penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p ->
draw. Logprobs come from the raw logits (vLLM's default).

Random rows draw by inverse CDF with one uniform per row: the cumulative sum runs along each
row alone, so a seeded row's token depends only on its own logits and its own generator, which
advances by exactly one draw per step whatever else is in the batch. On CPU this is far cheaper
than an exponential race, which needs V random numbers per row. A row that verifies a
speculative draft spends its uniform on the rejection rule instead (spec/rejection.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.sampling_draw import (NUM_NUCLEUS_CANDIDATES, sample_from_probs,
                                           truncation_cutoffs)
from kvrelay.engine.sampling_ops import (add_logit_bias_, apply_penalties_, ban_tokens_,
                                          greedy_tokens, keep_only_, top_logprobs)
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.spec.rejection import rejection_sample_any
from kvrelay.engine.structured import bitmask as token_bitmask

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits: one sequence being sampled this step."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far
    generator: torch.Generator | None  # set iff params.seed is set; lives as long as the sequence
    banned_token_ids: list[int]  # their logits become -inf (e.g. EOS before min_tokens)
    # The grammar's allowed tokens this step: int32 [ceil(V / 32)] (structured/backend.py).
    token_bitmask: torch.Tensor | None = None
    # Speculative verification: the draft token this row's sample accepts or refuses
    # (spec/rejection.py); None: an ordinary draw.
    draft_token_id: int | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # [B]; a row with a draft: the draft iff it was accepted
    logprobs: list[dict[int, float] | None]  # sampled token first, then the top params.logprobs
    ranks: list[int | None]  # 1 + tokens strictly more likely than the sampled one


def make_generator(seed: int, child_index: int = 0) -> torch.Generator:
    """CPU generator of one sequence; child i of an n > 1 request gets its own stream."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_child_seed(seed, child_index))
    return generator


def _child_seed(seed: int, child_index: int) -> int:
    # Child 0 keeps the seed, so n=1 and the first of n choices agree. Others go through
    # splitmix64, so (seed, i) does not collide with (seed + i, 0) as seed + i would.
    if child_index == 0:
        return seed & _MASK64
    mixed = (seed + 0x9E3779B97F4A7C15 * child_index) & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mixed ^ (mixed >> 31)


class Sampler:
    """Samples one step. Keeps [B, V] scratch buffers from step to step (a fresh tensor of that
    size costs page faults every time), so one Sampler serves one thread."""

    def __init__(self, num_nucleus_candidates: int = NUM_NUCLEUS_CANDIDATES):
        self.num_nucleus_candidates = num_nucleus_candidates
        self._scratch: dict[str, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [B, V] float32 or bf16, one row per entry of rows; never modified."""
        num_rows = len(rows)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {num_rows} rows")
        if num_rows == 0:
            return SamplerOutput([], [], [])
        banned = [i for i, row in enumerate(rows) if row.banned_token_ids]
        penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
        constrained = [i for i, row in enumerate(rows)
                       if row.token_bitmask is not None or row.params.constrains_tokens]
        with_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        edited = banned or penalized or constrained
        # (A greedy row's draft needs nothing: it is accepted iff it is the argmax.)
        if len(greedy) == num_rows and not (edited or with_logprobs):
            return SamplerOutput(greedy_tokens(logits).tolist(),
                                 [None] * num_rows, [None] * num_rows)

        raw_logprobs = None  # [L, V] from the logits as the model gave them
        if with_logprobs:
            raw_logprobs = torch.log_softmax(
                _take_rows(logits, with_logprobs), dim=-1, dtype=torch.float32,
                out=self._buffer("logprobs", len(with_logprobs), logits))
        work = logits  # [B, V] float32 contiguous, edited only in a scratch copy
        if edited or logits.dtype != torch.float32 or not logits.is_contiguous():
            work = self._buffer("logits", num_rows, logits).copy_(logits)
            self._constrain_(work, rows, constrained)
            self._edit_logits_(work, rows, banned, penalized)
            self._unban_emptied_(work, logits, rows, banned, constrained)

        tokens = torch.empty(num_rows, dtype=torch.long, device=work.device)  # [B]
        if greedy:
            tokens[greedy] = greedy_tokens(_take_rows(work, greedy))
        random_rows = [i for i in range(num_rows) if not rows[i].params.is_greedy]
        if random_rows:
            tokens[random_rows] = self._sample(work, rows, random_rows)
        return _output(tokens, rows, with_logprobs, raw_logprobs)

    def _constrain_(self, work: torch.Tensor, rows: list[SamplingRow],
                    constrained: list[int]) -> None:
        """The grammar's mask, then allowed_token_ids, then logit_bias, on the rows that have
        them: before every other edit, so the rest samples within the allowed set."""
        masked = [i for i in constrained if rows[i].token_bitmask is not None]
        if masked:
            token_bitmask.apply_(work, masked, torch.stack([rows[i].token_bitmask
                                                            for i in masked]))
        allowed = [i for i in constrained if rows[i].params.allowed_token_ids is not None]
        if allowed:
            keep_only_(work, allowed, [rows[i].params.allowed_token_ids for i in allowed])
        biased = [i for i in constrained if rows[i].params.logit_bias]
        if biased:
            add_logit_bias_(work, biased, [rows[i].params.logit_bias for i in biased])

    def _unban_emptied_(self, work: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow],
                        banned: list[int], constrained: list[int]) -> None:
        """A ban (EOS before min_tokens) that leaves a constrained row nothing to sample, as
        when the grammar allows only the end: the constraints win, the ban is dropped."""
        for i in set(banned) & set(constrained):
            if bool(torch.isneginf(work[i]).all()):
                work[i].copy_(logits[i])
                self._constrain_(work, rows, [i])
                penalized = [i] if rows[i].params.has_penalties else []
                self._edit_logits_(work, rows, [], penalized)

    def _edit_logits_(self, work: torch.Tensor, rows: list[SamplingRow], banned: list[int],
                      penalized: list[int]) -> None:
        if banned:
            ban_tokens_(work, banned, [rows[i].banned_token_ids for i in banned])
        if penalized:
            params = [rows[i].params for i in penalized]
            apply_penalties_(
                work, penalized,
                prompts=[rows[i].prompt_token_ids for i in penalized],
                outputs=[rows[i].output_token_ids for i in penalized],
                repetition=[p.repetition_penalty for p in params],
                frequency=[p.frequency_penalty for p in params],
                presence=[p.presence_penalty for p in params])

    def _sample(self, work: torch.Tensor, rows: list[SamplingRow],
                row_ids: list[int]) -> torch.Tensor:
        """work [B, V] processed logits; returns a token [R] for each of row_ids."""
        device = work.device
        params = [rows[i].params for i in row_ids]
        probs = self._buffer("probs", len(row_ids), work)  # [R, V]
        source = _take_rows(work, row_ids, out=probs)
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            divisor = torch.tensor(temperatures, dtype=work.dtype, device=device)[:, None]
            torch.div(source, divisor, out=probs)
        elif source is not probs:
            probs.copy_(source)
        # Unnormalized probabilities with each row's maximum exactly 1; the draw normalizes.
        probs.sub_(probs.amax(-1, keepdim=True)).exp_()
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            cutoff = truncation_cutoffs(
                probs,
                top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
                min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
                num_candidates=self.num_nucleus_candidates)
            dropped = self._buffer("dropped", len(row_ids), work, torch.bool)
            probs.masked_fill_(torch.lt(probs, cutoff[:, None], out=dropped), 0.0)
        uniforms = _uniforms([rows[i] for i in row_ids]).to(device)
        drafts = [rows[i].draft_token_id for i in row_ids]
        if any(draft is not None for draft in drafts):
            draft_ids = torch.tensor([-1 if draft is None else draft for draft in drafts],
                                     dtype=torch.long, device=device)
            return rejection_sample_any(probs, draft_ids, uniforms)
        return sample_from_probs(probs, uniforms)

    def _buffer(self, name: str, num_rows: int, like: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Scratch [num_rows, V] reused across steps; grows, never shrinks."""
        vocab_size = like.shape[1]
        buffer = self._scratch.get(name)
        if (buffer is None or buffer.numel() < num_rows * vocab_size or buffer.dtype != dtype
                or buffer.device != like.device):
            buffer = torch.empty(num_rows * vocab_size, dtype=dtype, device=like.device)
            self._scratch[name] = buffer
        return buffer[:num_rows * vocab_size].view(num_rows, vocab_size)


def _output(tokens: torch.Tensor, rows: list[SamplingRow], with_logprobs: list[int],
            raw_logprobs: torch.Tensor | None) -> SamplerOutput:
    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    ranks: list[int | None] = [None] * len(rows)
    if with_logprobs:
        dicts, row_ranks = top_logprobs(raw_logprobs, tokens[with_logprobs],
                                        [rows[i].params.logprobs for i in with_logprobs])
        for i, entry, rank in zip(with_logprobs, dicts, row_ranks):
            logprobs[i], ranks[i] = entry, rank
    return SamplerOutput(tokens.tolist(), logprobs, ranks)


def _take_rows(tensor: torch.Tensor, row_ids: list[int],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """tensor [B, V] -> [len(row_ids), V]; the tensor itself when row_ids is every row."""
    if len(row_ids) == tensor.shape[0]:
        return tensor
    index = torch.tensor(row_ids, device=tensor.device)
    return torch.index_select(tensor, 0, index, out=out) if out is not None \
        else tensor.index_select(0, index)


def _uniforms(rows: list[SamplingRow]) -> torch.Tensor:
    """One U[0, 1) per row [R] float64: from the row's generator when seeded, else batched
    from the default generator."""
    num_unseeded = sum(row.generator is None for row in rows)
    unseeded = iter(torch.rand(num_unseeded, dtype=torch.float64).tolist())
    values = [
        next(unseeded) if row.generator is None else
        torch.rand(1, dtype=torch.float64, generator=row.generator,
                   device=row.generator.device).item()
        for row in rows]
    return torch.tensor(values, dtype=torch.float64)
