"""Times the CPU attention path on typical SmolLM2-135M steps: decode rows in the native kernel
("native") and in the torch fallback ("torch"), with the reference for scale.

    .venv/bin/python -m kvrelay.kernels.bench_cpu_attention [--repeats N] [--threads N]

Times are medians per layer call of wall time and, in brackets, of process CPU time (all threads
summed), which other processes on a shared machine disturb less. The kernel's OpenMP workers only
have their CPU time booked at scheduler ticks, so for sub-millisecond calls the bracket undercounts. "step" multiplies by the
model's 30 layers and adds the once-per-step planning (for torch, its padded decode groups too).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from kvrelay.kernels import native_cpu
from kvrelay.kernels.metadata import build_attention_metadata
from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.kernels.attention_reference import paged_attention_reference
from kvrelay.kernels.cpu_decode_torch import plan_decode_groups

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE = 9, 3, 64, 30, 16


def make_step(query_lens: list[int], context_lens: list[int], dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 64
    pool = torch.randperm(num_blocks, generator=generator)  # scattered blocks, as after churn
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = pool[used : used + count]
        used += count
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    query = torch.randn(sum(query_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype)
    cu_seqlens_q = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(query_lens).cumsum(0)
    step = (cu_seqlens_q, torch.tensor(seq_lens, dtype=torch.int32), block_tables, BLOCK_SIZE)
    return query, k_cache, v_cache, step


def median_ms(fn, repeats: int) -> tuple[float, float]:
    """(wall, cpu) milliseconds per call."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - wall_start)
        cpu.append(time.process_time() - cpu_start)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


@contextlib.contextmanager
def decode_path(name: str):
    """Sends decode rows down the torch fallback for "torch", as if the build had failed."""
    native_op = native_cpu.paged_decode_op
    if name == "torch":
        native_cpu.paged_decode_op = lambda: None
    try:
        yield
    finally:
        native_cpu.paged_decode_op = native_op


def plan_step(step, path: str):
    meta = build_attention_metadata(*step)
    if path == "torch":
        meta.cpu_plan.padded_decode_groups = plan_decode_groups(meta.cpu_plan.decode, meta.cpu_plan.block_size)
    return meta


def bench_step(name: str, query_lens: list[int], context_lens: list[int], dtype: torch.dtype, repeats: int):
    query, k_cache, v_cache, step = make_step(query_lens, context_lens, dtype)
    scale = HEAD_DIM**-0.5
    meta = plan_step(step, "native")
    reference = paged_attention_reference(query, k_cache, v_cache, meta, scale)
    ref_ms = median_ms(lambda: paged_attention_reference(query, k_cache, v_cache, meta, scale), max(3, repeats // 4))
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"{name} {dtype_name}: reference {_pair(ref_ms)} ms/layer")
    for path in ("native", "torch"):
        with decode_path(path):
            meta = plan_step(step, path)
            error = (paged_attention_cpu(query, k_cache, v_cache, meta, scale).float() - reference.float()).abs().max()
            meta_ms = median_ms(lambda: plan_step(step, path), repeats)
            layer_ms = median_ms(lambda: paged_attention_cpu(query, k_cache, v_cache, meta, scale), repeats)
        step_ms = [NUM_LAYERS * layer + plan for layer, plan in zip(layer_ms, meta_ms)]
        print(
            f"  {path:<6} {_pair(layer_ms)} ms/layer  planning {_pair(meta_ms)} ms/step  "
            f"{NUM_LAYERS}-layer step {_pair(step_ms)} ms  err {error.item():.0e}"
        )


def _pair(wall_and_cpu) -> str:
    return f"{wall_and_cpu[0]:6.2f} ({wall_and_cpu[1]:6.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    decode_contexts = torch.randint(100, 501, (64,), generator=generator).tolist()
    native = "built" if native_cpu.paged_decode_op() is not None else "UNAVAILABLE"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native decode kernel {native}; "
          f"{NUM_Q_HEADS} q heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}")
    for dtype in (torch.float32, torch.bfloat16):
        bench_step("decode: 64 seqs, ctx 100-500", [1] * 64, decode_contexts, dtype, args.repeats)
        bench_step(
            "mixed: 64 decode + 2 prefill chunks",
            [1] * 64 + [256, 128],
            decode_contexts + [0, 300],
            dtype,
            args.repeats,
        )


if __name__ == "__main__":
    main()
