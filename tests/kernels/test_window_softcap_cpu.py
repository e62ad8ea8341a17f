"""Sliding windows and logit soft-capping on the CPU paths (native decode and prefill kernels, the
torch decode groups, SDPA and its explicit soft-capped stand-in) against the reference; the
reference itself against transformers' sliding-window mask and Gemma 2's eager attention; and
block-table entries before the window never read."""
from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_overlay
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from kvrelay.common import env_switches
from kvrelay.kernels import native_cpu
from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.kernels.attention_reference import gather_sequence
from kvrelay.kernels.dispatch import paged_attention
from kvrelay.kernels.metadata import build_attention_metadata
from tests.kernels.native_support import require_native_decode
from tests.kernels.window_cases import (
    POISON_CASES, POISON_WINDOW, SOFT_CAPS, TOLERANCE, WINDOW_ARGS, WINDOW_CASES, WINDOWS, max_error,
    poisoned_meta, reference, window_batch,
)


@pytest.fixture(params=["native", "native-decode-sdpa-prefill", "torch"])
def cpu_path(request, monkeypatch):
    """Decode rows and prefill sequences through the native kernels; native decode beside SDPA
    prefill (the prefill switch off); then the torch decode groups beside SDPA."""
    if request.param == "torch":
        monkeypatch.setattr(native_cpu, "paged_decode_op", lambda: None)
    else:
        require_native_decode()
    if request.param == "native-decode-sdpa-prefill":
        monkeypatch.setenv(env_switches.NATIVE_CPU_PREFILL.name, "0")
    return request.param


def _run_cpu(batch, soft_cap, meta=None):
    out = torch.full_like(batch.query, float("nan"))  # every element must be written
    paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, meta or batch.meta, batch.scale, out=out,
                        soft_cap=soft_cap)
    return out


@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(WINDOW_ARGS, WINDOW_CASES)
def test_cpu_paths_match_the_reference(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim,
                                       dtype, window, soft_cap, cpu_path):
    batch = window_batch(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim, window=window,
                         soft_cap=soft_cap, dtype=dtype)
    assert max_error(_run_cpu(batch, soft_cap), reference(batch, soft_cap)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("poison", ["nan-block", "out-of-range"])
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=["no-cap", "cap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(WINDOW_ARGS, POISON_CASES)
def test_blocks_before_the_window_are_never_read(query_lens, context_lens, block_size, num_kv_heads, group_size,
                                                 head_dim, dtype, soft_cap, poison, cpu_path):
    batch = window_batch(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim,
                         window=POISON_WINDOW,
                         soft_cap=soft_cap, dtype=dtype)
    expected = reference(batch, soft_cap)  # from the clean table
    poisoned = poisoned_meta(batch, poison)
    assert max_error(_run_cpu(batch, soft_cap, poisoned), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("poison", ["nan-block", "out-of-range"])
def test_the_reference_never_reads_blocks_before_the_window(poison):
    batch = window_batch([1, 3, 30], [90, 40, 70], 16, 1, 3, 64, window=20, soft_cap=5.0)
    assert torch.equal(reference(batch, 5.0, poisoned_meta(batch, poison)), reference(batch, 5.0))


def test_dispatch_takes_the_soft_cap_and_refuses_a_negative_one():
    batch = window_batch([1, 20], [30, 6], 16, 2, 3, 64, window=9, soft_cap=5.0)
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, soft_cap=5.0)
    assert max_error(out, reference(batch, 5.0)) <= 1e-4
    with pytest.raises(ValueError, match="soft_cap"):
        paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, soft_cap=-1.0)


def test_metadata_refuses_a_negative_window():
    with pytest.raises(ValueError, match="window"):
        build_attention_metadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                                 torch.zeros(1, 1, dtype=torch.int32), 16, window=-1)


def test_the_plan_gathers_only_the_keys_a_query_sees():
    # A chunk of 18 queries after 42 keys of context, window 8: the first query (position 42)
    # sees keys 35..42, the last (59) keys 52..59; the sequence's blocks are 4..7.
    meta = build_attention_metadata(torch.tensor([0, 1, 19], dtype=torch.int32),
                                    torch.tensor([30, 60], dtype=torch.int32),
                                    torch.arange(8, dtype=torch.int32).view(2, 4), 16, window=8)
    prefill = meta.cpu_plan.prefills[0]
    assert prefill.slot_ids.tolist() == [4 * 16 + key for key in range(35, 60)]
    assert prefill.causal_mask[0].tolist() == [True] * 8 + [False] * 17
    assert prefill.causal_mask[-1].tolist() == [False] * 17 + [True] * 8


def _transformers_attention(query, keys, values, context_len, scale, window, soft_cap):
    """One sequence through Gemma 2's eager attention with transformers' own causal and
    sliding-window mask functions: query [q, q_heads, d], keys/values [n, kv_heads, d]."""
    query_positions = context_len + torch.arange(query.shape[0])[:, None]
    key_positions = torch.arange(keys.shape[0])[None, :]
    visible = causal_mask_function(0, 0, query_positions, key_positions)
    if window:
        visible &= sliding_window_overlay(window)(0, 0, query_positions, key_positions)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=query.shape[1] // keys.shape[1], training=False)
    out, _ = eager_attention_forward(module, query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                     values.transpose(0, 1)[None], mask[None, None], scaling=scale,
                                     softcap=soft_cap or None)
    return out[0]  # [q, q_heads, d]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0, 50.0])
@pytest.mark.parametrize("window", [0, 1, 7, 16, 300])
@pytest.mark.parametrize("query_len, context_len", [(1, 60), (4, 30), (40, 0), (25, 50)])
def test_the_reference_is_transformers_sliding_window_and_gemma2_soft_cap(query_len, context_len, window,
                                                                          soft_cap):
    batch = window_batch([query_len], [context_len], 16, 2, 4, 64, window=window, soft_cap=soft_cap)
    seq_len = query_len + context_len
    keys = gather_sequence(batch.k_cache, batch.meta.block_tables[0], seq_len)
    values = gather_sequence(batch.v_cache, batch.meta.block_tables[0], seq_len)
    expected = _transformers_attention(batch.query, keys, values, context_len, batch.scale, window, soft_cap)
    assert max_error(reference(batch, soft_cap), expected) <= 1e-5
