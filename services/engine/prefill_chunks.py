"""How big a long prompt's chunk is while sequences decode.

A prefill chunk's cost grows with the context it attends to: its weight matmuls cost the same
at any position, but QK^T and PV cost one more unit per token already in the context. At a fixed
chunk size the last chunks of a 3,000-token prompt took twice as long as the first (SmolLM2-135M,
bf16, 2 cores), and every decoding sequence waits for them. So the chunk shrinks as the context
grows, keeping each one's compute near what the threshold costs at the start of a prompt.
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
