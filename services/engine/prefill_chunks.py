"""Whether prompts or decodes go first on shared compute, and how big a long prompt's chunk is
while sequences decode.

While sequences decode (on the worker, or on a worker sharing its cores), every prefill step
makes them wait, or with split cores slows itself. Two groups wait on each other: requests for
their first token, and sequences for their next. Normally the decodes keep their pace: a long
prompt goes in chunks, one at a time (and on CPUs a decode worker keeps a share of the cores).
Once more requests await a first token than sequences decode (a burst, or a backlog that built
up), the prompts go first until at most one is left: each step is filled to its budget with
whole prompts, as many as fit, on every core, so the burst's first tokens come a full step at a
time instead of a prompt at a time. (Without the "until", a burst would drop back to one prompt
a step half way, as soon as its first half outnumbered the rest.) Measured with vLLM's bench
client (random workload, 512-token prompts, 32 at a time; BENCHMARKS.md): one prompt at a time
on half the cores made the first tokens wait 26 s at the median.
"""
from __future__ import annotations


def attention_crossover(hf_config) -> int:
    """The context length at which a token's attention FLOPs (QK^T and PV, every head) equal
    the FLOPs of its weight matmuls, per layer: 3,072 for SmolLM2-135M, ~26,600 for Llama-3-8B."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, k, v, o projections
    weights += 3 * hidden * hf_config.intermediate_size  # gate, up, down
    # Matmuls: 2 FLOPs per weight. Attention: 2 (QK^T) + 2 (PV) per head dim per context token.
    return round(2 * weights / (4 * heads * head_dim))


def long_prefill_chunk(threshold: int, context_len: int, crossover: int) -> int:
    """The chunk for a prompt with `context_len` tokens already computed: `threshold` tokens at
    the start, fewer further in, so that chunk * (1 + context / crossover) stays ~ threshold.
    crossover 0: the threshold at every position."""
    if not crossover:
        return threshold
    return max(1, threshold * crossover // (crossover + context_len))


def prompts_first(already: bool, num_awaiting_first_token: int, num_decoding: int) -> bool:
    """Whether prompts go first this step (whole, filling the step, on every core): from when
    more requests await their first token than sequences decode (`already`: they went first
    in the step before) until at most one awaits. A lone prompt never does: it is chunked."""
    if num_awaiting_first_token <= 1:
        return False
    return already or num_awaiting_first_token > num_decoding
