"""The Triton kernel under a sliding window and a soft cap, in the CPU interpreter (conftest.py
sets TRITON_INTERPRET), against the reference on fresh random inputs; block-table entries
before the window pointing at a block of NaN must not change a thing."""
import pytest
import torch

from kvrelay.kernels.triton_paged_attention import paged_attention_triton
from tests.kernels.window_cases import (
    POISON_CASES, POISON_WINDOW, TOLERANCE, WINDOW_ARGS, WINDOW_CASES, max_error, poisoned_meta, reference,
    window_batch,
)


def _run(batch, soft_cap, meta=None):
    out = torch.full_like(batch.query, float("nan"))  # every element must be written
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, meta or batch.meta, batch.scale, out=out,
                           soft_cap=soft_cap)
    return out


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [1, 8, 37, 4096], ids=lambda w: f"w{w}")
@pytest.mark.parametrize(WINDOW_ARGS, WINDOW_CASES)
def test_triton_matches_the_reference_fp32(query_lens, context_lens, block_size, num_kv_heads, group_size,
                                           head_dim, window, soft_cap):
    batch = window_batch(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim, window=window,
                         soft_cap=soft_cap)
    assert max_error(_run(batch, soft_cap), reference(batch, soft_cap)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
def test_triton_matches_the_reference_bf16(soft_cap):
    batch = window_batch([1, 9, 3, 40], [21, 7, 30, 50], 16, 1, 3, 64, window=13, soft_cap=soft_cap,
                         dtype=torch.bfloat16)
    assert max_error(_run(batch, soft_cap), reference(batch, soft_cap)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize(WINDOW_ARGS, POISON_CASES)
def test_triton_never_reads_blocks_before_the_window(query_lens, context_lens, block_size, num_kv_heads,
                                                     group_size, head_dim, soft_cap):
    batch = window_batch(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim,
                         window=POISON_WINDOW, soft_cap=soft_cap)
    expected = reference(batch, soft_cap)  # from the clean table
    assert max_error(_run(batch, soft_cap, poisoned_meta(batch, "nan-block")), expected) <= TOLERANCE[torch.float32]
