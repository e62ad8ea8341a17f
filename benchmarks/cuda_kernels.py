"""The Triton kernels on a device: correctness against the torch references on fresh random
inputs, the device's copy bandwidth, and the paged decode attention's achieved bandwidth.
Used by benchmarks/cuda_check.py; every function also runs on CPU tensors under
TRITON_INTERPRET=1 (its smoke mode), where the timings mean nothing."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import build_attention_metadata
from kvrelay.kernels.attention_reference import paged_attention_reference
from kvrelay.kernels.store_kv_torch import store_kv_reference


@dataclass(slots=True)
class HeadShape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA3_8B_HEADS = HeadShape("Llama-3-8B", 32, 8, 128)
SMOLLM2_HEADS = HeadShape("SmolLM2-135M", 9, 3, 64)


def device_timer(device: torch.device, fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` (CUDA events on a GPU, wall time on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def paged_batch(query_lens: list[int], context_lens: list[int], heads: HeadShape,
                block_size: int, dtype: torch.dtype, device: torch.device, seed: int,
                kv_format: str = "auto"):
    """(query, k_cache, v_cache, metadata) over shuffled blocks; unwritten slots hold NaN so a
    kernel that reads one shows it (an 8-bit row of 0xff bytes has a NaN scale)."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    pool = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    slots, used = [], 0
    for seq, (count, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        tables[seq, :count] = pool[used:used + count]
        used += count
        positions = torch.arange(seq_len)
        slots.append(tables[seq].long()[positions // block_size] * block_size
                     + positions % block_size)
    fmt = kv_quant.parse(kv_format)
    shape = (num_blocks, block_size, heads.num_kv_heads, kv_quant.row_width(heads.head_dim, fmt))
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype, device=device) if fmt is None
                        else torch.full(shape, 0xff, dtype=torch.uint8, device=device).view(fmt.dtype)
                        for _ in range(2))
    total = sum(seq_lens)
    keys = torch.randn(total, heads.num_kv_heads, heads.head_dim, generator=generator)
    values = torch.randn(total, heads.num_kv_heads, heads.head_dim, generator=generator)
    store_kv_reference(keys.to(device, dtype), values.to(device, dtype), k_cache, v_cache,
                       torch.cat(slots).to(device))
    query = torch.randn(sum(query_lens), heads.num_q_heads, heads.head_dim,
                        generator=generator).to(device, dtype)
    cu_seqlens = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(query_lens).cumsum(0)
    meta = build_attention_metadata(cu_seqlens.to(device),
                                    torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                    tables.to(device), block_size, max(query_lens),
                                    max(seq_lens))
    return query, k_cache, v_cache, meta


def attention_cases(smoke: bool) -> list[tuple[str, list[int], list[int]]]:
    """(name, query lengths, context lengths): decode, whole prompts, chunked prefill, mixed."""
    if smoke:
        return [("decode", [1, 1, 1], [5, 17, 33]), ("prefill", [7, 20], [0, 0]),
                ("mixed", [1, 9, 1], [40, 13, 3])]
    generator = torch.Generator().manual_seed(0)
    draw = lambda low, high, n: torch.randint(low, high, (n,), generator=generator).tolist()  # noqa: E731
    return [("decode", [1] * 16, draw(1, 4096, 16)), ("prefill", draw(1, 700, 6), [0] * 6),
            ("chunked prefill", draw(64, 512, 6), draw(1, 3000, 6)),
            ("mixed", [1] * 8 + draw(16, 300, 3), draw(1, 2000, 8) + draw(0, 500, 3))]


def check_attention(device: torch.device, smoke: bool) -> list[dict]:
    from kvrelay.kernels.triton_paged_attention import paged_attention_triton
    rows = []
    heads_list = [HeadShape("tiny", 4, 2, 32)] if smoke else [LLAMA3_8B_HEADS, SMOLLM2_HEADS]
    for heads in heads_list:
        for dtype, tolerance in ((torch.bfloat16, 3e-2), (torch.float16, 5e-3),
                                 (torch.float32, 2e-3)):
            for seed, (name, query_lens, context_lens) in enumerate(attention_cases(smoke)):
                query, k_cache, v_cache, meta = paged_batch(query_lens, context_lens, heads, 16,
                                                            dtype, device, seed)
                scale = heads.head_dim ** -0.5
                got = paged_attention_triton(query, k_cache, v_cache, meta, scale).float()
                want = paged_attention_reference(query.float(), k_cache.float(),
                                                 v_cache.float(), meta, scale)
                error = (got - want).abs().max().item()
                rows.append({"kernel": "paged attention", "heads": heads.name,
                             "dtype": str(dtype).removeprefix("torch."), "case": name,
                             "max_abs_error": error, "ok": error <= tolerance})
    return rows


def check_attention_8bit(device: torch.device, smoke: bool) -> list[dict]:
    """The kernel on 8-bit caches (kernels/kv_quant.py: rows coded by torch's ops as the worker
    stores them) against the reference on the same rows, bf16 queries."""
    from kvrelay.kernels.triton_paged_attention import paged_attention_triton
    rows = []
    heads_list = [HeadShape("tiny", 4, 2, 32)] if smoke else [LLAMA3_8B_HEADS, SMOLLM2_HEADS]
    for heads in heads_list:
        for kv_format in ("int8", "fp8_e4m3"):
            for seed, (name, query_lens, context_lens) in enumerate(attention_cases(smoke)):
                query, k_cache, v_cache, meta = paged_batch(query_lens, context_lens, heads, 16,
                                                            torch.bfloat16, device, seed, kv_format)
                scale = heads.head_dim ** -0.5
                got = paged_attention_triton(query, k_cache, v_cache, meta, scale).float()
                want = paged_attention_reference(query.float(), k_cache, v_cache, meta, scale)
                error = (got - want).abs().max().item()
                rows.append({"kernel": "paged attention, 8-bit KV", "heads": heads.name,
                             "dtype": kv_format, "case": name, "max_abs_error": error,
                             "ok": error <= 3e-2})
    return rows


def check_store_kv(device: torch.device, smoke: bool) -> list[dict]:
    from kvrelay.kernels.triton_store_kv import store_kv_triton
    rows = []
    num_tokens, heads = (9, HeadShape("tiny", 4, 2, 32)) if smoke else (4096, LLAMA3_8B_HEADS)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        shape = (num_tokens // 4 + 8, 16, heads.num_kv_heads, heads.head_dim)
        key = torch.randn(num_tokens, heads.num_kv_heads, heads.head_dim).to(device, dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(shape[0] * 16)[:num_tokens].to(device)
        slots[::7] = -1  # padding tokens: not stored
        caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(4)]
        store_kv_triton(key, value, caches[0], caches[1], slots)
        store_kv_reference(key, value, caches[2], caches[3], slots)
        same = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        rows.append({"kernel": "store kv", "heads": heads.name,
                     "dtype": str(dtype).removeprefix("torch."), "case": f"{num_tokens} tokens",
                     "max_abs_error": 0.0 if same else float("inf"), "ok": same})
    return rows


def check_rejection(device: torch.device, smoke: bool) -> list[dict]:
    """The speculative rejection kernel against its torch reference (run on the CPU), on
    fresh random target rows: the tokens must agree but for draws within rounding of a CDF
    boundary, and acceptance must agree everywhere."""
    from kvrelay.kernels.triton_rejection import rejection_sample_triton
    from kvrelay.engine.spec.rejection import rejection_sample
    num_rows, vocab_size = (9, 300) if smoke else (4096, 128256)
    probs = torch.rand(num_rows, vocab_size) ** 4
    drafts = torch.randint(0, vocab_size, (num_rows,))
    drafts[::3] = -1
    drafts[1::3] = probs.argmax(-1)[1::3]
    uniforms = torch.rand(num_rows, dtype=torch.float64)
    want = rejection_sample(probs, drafts, uniforms)
    got = rejection_sample_triton(probs.to(device), drafts.to(device), uniforms.to(device)).cpu()
    accept_same = torch.equal(got == drafts, want == drafts)
    num_differ = int((got != want).sum())
    seconds = device_timer(device, lambda: rejection_sample_triton(
        probs.to(device), drafts.to(device), uniforms.to(device)), repeats=3 if smoke else 20)
    ok = accept_same and num_differ <= max(1, num_rows // 1000)
    return [{"kernel": "spec rejection", "heads": f"vocab {vocab_size}", "dtype": "float32",
             "case": f"{num_rows} rows, {seconds * 1e3:.2f} ms",
             "max_abs_error": float(num_differ), "ok": ok}]


def check_moe(device: torch.device, smoke: bool) -> list[dict]:
    """The Triton mixture-of-experts kernels against the per-token reference (on the device),
    in a Qwen3-30B-A3B-like layer (128 experts, 8 per token) on fresh random inputs."""
    from kvrelay.kernels.moe_reference import fused_moe_reference
    from kvrelay.kernels.moe_routing import select_experts
    from kvrelay.kernels.moe_weights import ExpertWeights
    from kvrelay.kernels.triton_moe import fused_moe_triton
    num_experts, top_k, hidden, inter = (6, 2, 32, 24) if smoke else (128, 8, 2048, 768)
    dtype = torch.float32 if smoke and device.type == "cpu" else torch.bfloat16
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) / inter ** 0.5
    experts = ExpertWeights(w13.to(dtype), w2.to(dtype))
    tolerance = 1e-4 if dtype == torch.float32 else 0.07
    rows = []
    for num_tokens in ((1, 5) if smoke else (1, 64, 512)):
        x = torch.randn(num_tokens, hidden, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(num_tokens, num_experts, device=device),
                                      top_k, renormalize=True)
        got = fused_moe_triton(x, experts, weights, ids, "silu")
        want = fused_moe_reference(x, experts, weights, ids, "silu")
        error = float((got.float() - want.float()).abs().max())
        seconds = device_timer(device, lambda: fused_moe_triton(x, experts, weights, ids, "silu"),
                               repeats=3 if smoke else 20)
        rows.append({"kernel": "moe", "heads": f"E={num_experts} k={top_k} H={hidden} I={inter}",
                     "dtype": str(dtype).removeprefix("torch."),
                     "case": f"{num_tokens} tokens, {seconds * 1e3:.3f} ms",
                     "max_abs_error": error, "ok": error <= tolerance})
    return rows


def copy_bandwidth(device: torch.device, smoke: bool) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    num_bytes = (16 << 20) if smoke else (2 << 30)
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = device_timer(device, lambda: target.copy_(source), repeats=3 if smoke else 20)
    return 2 * num_bytes / seconds


def attention_bandwidth(device: torch.device, smoke: bool, copy_bytes_per_s: float,
                        max_kv_bytes: float) -> list[dict]:
    """Decode attention (one query token per sequence) for batch x context: bytes read over
    the kernel's time, against the copy bandwidth."""
    from kvrelay.kernels.triton_paged_attention import paged_attention_triton
    heads = HeadShape("tiny", 4, 2, 32) if smoke else LLAMA3_8B_HEADS
    batches, contexts = ((1, 4), (64, 256)) if smoke else ((1, 8, 32, 128),
                                                           (1024, 4096, 16384, 32768))
    rows = []
    for batch in batches:
        for context in contexts:
            kv_bytes = batch * context * heads.num_kv_heads * heads.head_dim * 2 * 2  # K+V bf16
            if kv_bytes > max_kv_bytes:
                continue
            query, k_cache, v_cache, meta = paged_batch([1] * batch, [context - 1] * batch,
                                                        heads, 16, torch.bfloat16, device, 0)
            out = torch.empty_like(query)
            scale = heads.head_dim ** -0.5
            seconds = device_timer(device, lambda: paged_attention_triton(
                query, k_cache, v_cache, meta, scale, out), repeats=3 if smoke else 20)
            moved = kv_bytes + 2 * query.numel() * query.element_size()
            rows.append({"batch": batch, "context": context, "seconds": seconds,
                         "bytes_per_s": moved / seconds,
                         "of_copy_bandwidth": moved / seconds / copy_bytes_per_s})
            del k_cache, v_cache
    return rows
