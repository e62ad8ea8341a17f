"""A worker's first forward passes of each shape pay for oneDNN primitive creation, allocator
growth and first-touch page faults: right after `kvrelay up` said ready, a Poisson sweep's first
rate reached 30% goodput and the next ones 98-100%. So a worker runs the step shapes of its role
once before it registers and reports SERVING (vLLM warms up before it serves, too).

Those passes compile oneDNN's kernels for their own row counts only, and a serving step's row
count is padded to one of ~60 buckets (services/engine/step_padding.py), each compiled on first
use (~10-30 ms a bucket at first sight). So every bucket up to the default token budget is also
run once through the first layer's packed matmuls, on zeros: oneDNN keeps a kernel per weight
shape and row count, whatever the weights, so that warms every layer (~1 s in all).

The passes write K/V into the first blocks of the cache, which no sequence holds yet: every
real sequence writes a slot's K/V before anything reads it. Only bf16 on CPU warms up: its
packed oneDNN matmuls JIT-compile a kernel per batch shape and its 4-bit path has its own; the
float32 path (MKL's precompiled GEMMs, what the parity tests run) has nothing to compile.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.models.packed_linear import warm_onednn_rows
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sampling_ops import greedy_tokens
from kvrelay.engine.step_padding import bucket_sizes

DECODE_BATCHES = (1, 8, 64)  # the int4 path (<= 8 tokens) and the packed bf16 one
DECODE_CONTEXT = 64
PREFILL_CHUNKS = ((512,), (512, 512, 512, 512))  # one prompt; a 2,048-token step of four
# steps up to this many rows find their bucket's matmul kernels compiled (the scheduler's
# default budget; a larger --max-num-batched-tokens compiles the rest on first use)
WARM_BUCKET_ROWS = EngineConfig().max_num_batched_tokens


@dataclass(slots=True)
class _Sequence:
    """What ModelRunner.prepare reads of a request."""
    all_token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)  # no prompt logprobs
    adapter_id: int = 0  # the base model (a LoRA step runs the same matmuls, and more)


@dataclass(slots=True)
class _Item:
    request: _Sequence
    num_new_tokens: int
    block_ids: list[list[int]]  # per KV group
    draft_token_ids: list[int] = field(default_factory=list)
    samples: bool = True


def needs_warm_up(runner: ModelRunner) -> bool:
    return runner.device.type == "cpu" and runner.dtype == torch.bfloat16


def warm_up(runner: ModelRunner, role: str) -> float:
    """Run the role's step shapes once; returns the seconds it took."""
    started = time.perf_counter()
    shapes = []
    if role in ("prefill", "both"):
        shapes += [[(0, length) for length in chunk] for chunk in PREFILL_CHUNKS]
    if role in ("decode", "both"):
        shapes += [[(DECODE_CONTEXT, 1)] * batch for batch in DECODE_BATCHES]
    for shape in shapes:
        items = _items(shape, runner.block_size, runner.num_blocks, runner.kv_layout.num_groups)
        if items:
            greedy_tokens(runner.execute(runner.prepare(items)))
    warm_onednn_rows(runner.model.layers[0], warm_bucket_rows(runner))
    return time.perf_counter() - started


def warm_bucket_rows(runner: ModelRunner) -> list[int]:
    """The padded row counts whose oneDNN kernels warm_up compiles."""
    return bucket_sizes(runner.pad_from_rows, WARM_BUCKET_ROWS)


def _items(shape: list[tuple[int, int]], block_size: int, num_blocks: int,
           num_groups: int = 1) -> list[_Item]:
    """(context, new tokens) per sequence -> items on distinct blocks (a table per KV group);
    [] if the cache is too small for the shape (a tiny test cache)."""
    items, next_block = [], 0
    for context, num_new in shape:
        total = context + num_new
        count = -(-total // block_size)
        if next_block + count * num_groups > num_blocks:
            return []
        tables = [list(range(next_block + count * group, next_block + count * (group + 1)))
                  for group in range(num_groups)]
        items.append(_Item(_Sequence([1] * total, context), num_new, tables))
        next_block += count * num_groups
    return items
