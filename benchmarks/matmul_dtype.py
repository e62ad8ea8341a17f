"""float32 vs bfloat16 matmul speed on this CPU, on the engine's own GEMM shapes.

    python benchmarks/matmul_dtype.py

Shapes: SmolLM2-135M's fused gate/up projection ([M, 576] x [576, 3072]) for a decode batch
(M=64) and a prefill chunk (M=2048), and the LM head ([64, 576] x [576, 49152]).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = [("gate_up decode", 64, 576, 3072), ("gate_up prefill", 2048, 576, 3072),
          ("lm_head decode", 64, 576, 49152)]


def best_ms(fn, repeats: int = 7, calls: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| GEMM | M x K x N | float32 ms | bfloat16 ms | bf16 packed ms | fp32 / bf16 packed |")
    print("|---|---|---|---|---|---|")
    for name, m, k, n in SHAPES:
        row = []
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            row.append(best_ms(lambda: F.linear(x, w)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        row.append(best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                      [], "")))
        print(f"| {name} | {m}x{k}x{n} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | "
              f"{row[0] / row[2]:.1f}x |")


if __name__ == "__main__":
    main()
