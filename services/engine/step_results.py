"""What a step computes besides sampled tokens, as plain data (no torch: the scheduler and the
gateway carry it): prompt logprobs (prompt_logprobs.py) and embeddings (pooling.py)."""
from __future__ import annotations

from dataclasses import dataclass

POOLINGS = ("last", "mean")  # of SamplingParams.pooling


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """One step's prompt logprobs of one sequence: entries[i] is prompt token
    first_position + i's (positions count from 0; the first token has none)."""
    sequence_id: str
    first_position: int
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class Pooled:
    """An embedding a step finished."""
    sequence_id: str
    values: tuple[float, ...]  # [hidden], unit length
