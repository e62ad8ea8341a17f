"""The CPU mixture-of-experts path against the dense MLP of equal active size, in bf16.

E experts, k per token, each of intermediate size I = dense_inter / k: every token multiplies
as many weights as in the dense [hidden x dense_inter] MLP. Three contenders per token count:
  moe    kernels/moe_dispatch.fused_moe on oneDNN-packed experts (prepare_for_cpu_)
  dense  the dense MLP as the model runs it: PackedLinear gate_up, silu_and_mul, PackedLinear down
  naive  a loop over the active experts with F.linear (unpacked weights), torch's silu
Prints the median ms of each, measured in alternating rounds so that load drifts hit all alike.
With --layers N each contender cycles through N independent copies of its weights, as a model's
forward pass does: the weights then come from memory, not from a cache that held the last call's.

  python -m benchmarks.moe_cpu [--threads 1] [--tokens 1 8 64 512] [--layers 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from kvrelay.engine.models.packed_linear import PackedLinear
from kvrelay.kernels.moe_activations import gated
from kvrelay.kernels.moe_dispatch import fused_moe
from kvrelay.kernels.moe_routing import select_experts
from kvrelay.kernels.moe_weights import ExpertWeights


def _naive(hidden, w13, w2, topk_weights, topk_ids):  # per-expert F.linear, unpacked
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        act = gated("silu", F.linear(hidden[token], w13[expert]))
        y = F.linear(act, w2[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y)
    return out.to(hidden.dtype)


def _layer(tokens: int, args) -> dict:
    hidden_size, inter = args.hidden, args.dense_inter // args.top_k
    w13 = torch.randn(args.experts, 2 * inter, hidden_size).bfloat16() / hidden_size ** 0.5
    w2 = torch.randn(args.experts, hidden_size, inter).bfloat16() / inter ** 0.5
    experts = ExpertWeights(w13.clone(), w2.clone())
    experts.prepare_for_cpu_()
    gate_up = PackedLinear(torch.randn(2 * args.dense_inter, hidden_size).bfloat16(), None)
    down = PackedLinear(torch.randn(hidden_size, args.dense_inter).bfloat16(), None)
    hidden = torch.randn(tokens, hidden_size).bfloat16()
    topk_weights, topk_ids = select_experts(torch.randn(tokens, args.experts), args.top_k, True)
    return {
        "moe": lambda: fused_moe(hidden, experts, topk_weights, topk_ids, "silu"),
        "dense": lambda: down(gated("silu", gate_up(hidden))),
        "naive": lambda: _naive(hidden, w13, w2, topk_weights, topk_ids),
    }


def _contenders(tokens: int, args) -> dict:
    """name -> one call through every layer copy."""
    torch.manual_seed(tokens)
    layers = [_layer(tokens, args) for _ in range(args.layers)]
    return {name: lambda name=name: [layer[name]() for layer in layers] for name in layers[0]}


def _median_ms(contenders: dict, rounds: int, calls: int) -> dict:
    times = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()  # oneDNN compiles a kernel per shape on first use
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dense-inter", type=int, default=1536)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=1, help="weight copies cycled per call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"E={args.experts} k={args.top_k} H={args.hidden} I={args.dense_inter // args.top_k} "
          f"bf16, {args.threads} thread(s), {args.layers} layer copies; median ms per layer")
    print(f"{'T':>5} {'moe':>8} {'dense':>8} {'naive':>8} {'moe/dense':>10}")
    with torch.inference_mode():
        for tokens in args.tokens:
            calls = max(1, 256 // tokens // args.layers)
            ms = {name: total / args.layers for name, total in
                  _median_ms(_contenders(tokens, args), args.rounds, calls).items()}
            print(f"{tokens:>5} {ms['moe']:>8.3f} {ms['dense']:>8.3f} {ms['naive']:>8.3f} "
                  f"{ms['moe'] / ms['dense']:>10.2f}")


if __name__ == "__main__":
    main()
