"""Which contiguous layers each pipeline stage runs.

By default the split balances what a token costs each stage, the matmul weights it goes
through: a layer's attention and MLP (a mixture-of-experts layer's routed experts, top_k of
them), and on the first stage the vocabulary head too (it samples, so it holds the embedding and
the head; on a small model the head weighs as much as several layers). Only sampled rows reach
the head, so it is counted at half its weight: a chat workload computes about as many prompt
tokens (no head) as output tokens (measured on chat-64 through a colocated worker, 2 stages of
the default model: 11 + 19 layers, the head counted whole, left the second stage the busier).
`--pp-layer-partition "11,19"` gives the counts by hand, as vLLM's VLLM_PP_LAYER_PARTITION does.
"""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """"11,19" -> (11, 19); None or "" -> None (balanced)."""
    if not text:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"pp layer partition must be comma-separated layer counts, "
                         f"got {text!r}") from None
    return counts


def stage_layers(spec: ArchSpec, num_stages: int,
                 counts: tuple[int, ...] | None = None) -> list[range]:
    """Per stage, its layers (ValueError where the split cannot be made)."""
    num_layers = spec.num_layers
    if num_stages < 1:
        raise ValueError(f"pipeline parallel size must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"pipeline parallel size {num_stages} exceeds the model's "
                         f"{num_layers} layers")
    if counts is None:
        counts = balanced_counts([layer_cost(spec, index) for index in range(num_layers)],
                                 num_stages, head_cost(spec))
    if len(counts) != num_stages or any(count < 1 for count in counts) \
            or sum(counts) != num_layers:
        raise ValueError(f"pp layer partition {','.join(map(str, counts))}: needs "
                         f"{num_stages} counts of at least 1 layer summing to {num_layers}")
    starts = [sum(counts[:stage]) for stage in range(num_stages + 1)]
    return [range(starts[stage], starts[stage + 1]) for stage in range(num_stages)]


def layer_cost(spec: ArchSpec, index: int) -> int:
    """Weights a decode row reads in layer `index` (parameters)."""
    hidden, q_size = spec.hidden_size, spec.num_heads * spec.head_dim
    attention = hidden * (2 * q_size + 2 * spec.num_kv_heads * spec.head_dim)
    if spec.moe_layers[index]:
        mlp = 3 * hidden * spec.moe.intermediate_size * spec.moe.top_k
    else:
        mlp = 3 * hidden * spec.intermediate_size
    return attention + mlp


def head_cost(spec: ArchSpec) -> int:
    """The head's weights, halved: a prompt token's row does not reach it."""
    return spec.vocab_size * spec.hidden_size // 2


def balanced_counts(costs: list[int], num_stages: int, first_extra: int) -> tuple[int, ...]:
    """Contiguous counts minimising the costliest stage, the first carrying `first_extra`
    (dynamic programming over split points: layers and stages are few)."""
    num_layers = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][n]: the least max cost placing the first n layers on stages 0..s-1
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stage in range(1, num_stages + 1):
        extra = first_extra if stage == 1 else 0
        for end in range(stage, num_layers + 1):
            for start in range(stage - 1, end):
                worst = max(best[stage - 1][start], prefix[end] - prefix[start] + extra)
                if worst < best[stage][end]:
                    best[stage][end], cut[stage][end] = worst, start
    counts, end = [], num_layers
    for stage in range(num_stages, 0, -1):
        start = cut[stage][end]
        counts.append(end - start)
        end = start
    return tuple(reversed(counts))
