"""How fast this machine reads memory the way decode attention reads the KV cache: 1 and 2
OpenMP threads, AVX-512 loads, sequentially and in scattered blocks of a KV block's size (16
tokens x 3 kv heads x 64 dims of bf16 = 6 KB of K). Against the attention kernel's own rate
(bytes of K/V it needs over its time) this says how far the kernel is from the layout's bound.

    .venv/bin/python benchmarks/read_bandwidth.py [--mib 1024] [--block-bytes 6144,2048]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// Sums the floats of each 128-byte step (two vectors) so the loads cannot be dropped.
static inline void add_span(const char* p, int64_t bytes, __m512& a, __m512& b) {
  for (int64_t i = 0; i < bytes; i += 128) {
    a = _mm512_add_ps(a, _mm512_loadu_ps((const float*)(p + i)));
    b = _mm512_add_ps(b, _mm512_loadu_ps((const float*)(p + i + 64)));
  }
}

// Reads buf's blocks in `order` (block indices), block_bytes each, on `threads` threads.
double read_blocks(torch::Tensor buf, torch::Tensor order, int64_t block_bytes, int64_t threads) {
  const char* base = (const char*)buf.data_ptr();
  const int64_t* blocks = order.data_ptr<int64_t>();
  const int64_t count = order.numel();
  float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) add_span(base + blocks[i] * block_bytes, block_bytes, a, b);
    total += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  return total;
}
"""


def best_gb_s(fn, nbytes: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="buffer size (well past the caches)")
    parser.add_argument("--block-bytes", default="6144,2048")
    args = parser.parse_args()
    module = load_inline("kvrelay_read_bandwidth", cpp_sources=SOURCE, functions=["read_blocks"],
                         extra_cflags=["-O3", "-march=native", "-fopenmp"],
                         extra_ldflags=["-fopenmp"])
    nbytes = args.mib << 20
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    sizes = [int(size) for size in args.block_bytes.split(",") if size]
    for threads in (1, 2):
        line = [f"{threads} thread(s)"]
        sequential_block = 1 << 20
        in_order = torch.arange(nbytes // sequential_block)
        line.append(f"sequential {best_gb_s(lambda: module.read_blocks(buffer, in_order, sequential_block, threads), nbytes):.1f} GB/s")
        for size in sizes:
            scattered = torch.randperm(nbytes // size)
            gb_s = best_gb_s(lambda: module.read_blocks(buffer, scattered, size, threads), scattered.numel() * size)
            line.append(f"{size}-byte blocks scattered {gb_s:.1f} GB/s")
        print(", ".join(line))


if __name__ == "__main__":
    main()
