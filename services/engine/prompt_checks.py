"""What a prompt must pass before it is queued, checked in one place for the offline engine
(EngineCore.add_request) and the scheduler service (ClusterScheduler.submit) alike; the
messages reach users as they are (a ValueError offline, INVALID_ARGUMENT / a 400 through the
services)."""
from __future__ import annotations

from collections.abc import Sequence

from kvrelay.engine.sampling_params import SamplingParams


def check_prompt_tokens(prompt_token_ids: Sequence[int], params: SamplingParams,
                        vocab_size: int) -> None:
    """Raises ValueError for an empty prompt, or one whose tokens or whose sampling
    parameters' token ids (stop tokens, bad words, logit bias...) lie outside the vocabulary."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    bad = [t for t in params.token_ids_used() if t >= vocab_size]
    if bad:
        raise ValueError(f"sampling parameters name token ids out of range "
                         f"[0, {vocab_size}): {bad[:5]}")
