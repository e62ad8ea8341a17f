"""Large bf16 CPU steps are padded to a bucketed row count (services/engine/step_padding.py):
the pad rows store no K/V, are no sequence's query and change no answer."""
from __future__ import annotations

import pytest
import torch

from kvrelay.kernels.metadata import build_attention_metadata
from kvrelay.kernels.onednn_linear import onednn_packs_bf16
from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.step_padding import bucket_grain, bucket_sizes, padded_rows
from kvrelay.worker.warmup import _items


def test_buckets_are_16_rows_up_to_512_then_double_each_octave():
    assert [bucket_grain(n) for n in (65, 512, 513, 1024, 1025, 2048, 2049)] == \
        [16, 16, 32, 32, 64, 64, 128]
    assert [padded_rows(n, 65) for n in (64, 65, 170, 176, 177, 513, 2040, 2049)] == \
        [64, 80, 176, 176, 192, 544, 2048, 2176]
    assert padded_rows(170, None) == 170  # nothing reaches oneDNN: nothing pads
    for n in range(65, 4097):
        assert n <= padded_rows(n, 65) < n + bucket_grain(n)
        assert padded_rows(n, 65) - n <= max(15, n // 16)  # at most ~6% above 256 rows


def test_bucket_sizes_lists_every_row_count_a_padded_step_can_have():
    buckets = bucket_sizes(65, 2048)
    assert buckets[:3] == [80, 96, 112] and buckets[-2:] == [1984, 2048]
    assert buckets == sorted(set(buckets)) and len(buckets) == 60
    assert {padded_rows(n, 65) for n in range(65, 2049)} == set(buckets)
    assert bucket_sizes(None, 2048) == [] and bucket_sizes(65, 64) == []


@pytest.fixture(scope="module")
def bf16():
    return LLM(dtype="bfloat16", num_kv_blocks=256)


def test_only_steps_that_reach_onednn_pad(bf16):
    runner = bf16.engine.runner
    if not onednn_packs_bf16():  # an AVX2-only CPU: F.linear takes the large steps unpadded
        assert runner.pad_from_rows is None
        return
    # oneDNN takes the steps above the largest small-step kernel this CPU runs: AMX tiles where
    # it has them, else the VNNI kernel, else the 4-bit gemv.
    if runner.uses_amx:
        largest_small = runner.amx_max_tokens
    elif runner.q4a8 is not None:
        largest_small = runner.q4a8_max_tokens
    else:
        largest_small = runner.int4_max_tokens
    assert runner.pad_from_rows == largest_small + 1
    below = runner.pad_from_rows - 1  # the largest step the small-step kernels take
    small = runner.prepare(_items([(0, below)], runner.block_size, runner.num_blocks))
    assert small.input_ids.shape[0] == below
    step = runner.prepare(_items([(0, 90), (0, 80)], runner.block_size, runner.num_blocks))
    assert step.input_ids.shape[0] == 176 and int(step.cu_seqlens_q[-1]) == 170
    assert step.slot_mappings[0][170:].tolist() == [-1] * 6
    assert step.positions[170:].tolist() == [0] * 6


def test_a_padded_step_stores_and_answers_as_an_unpadded_one(bf16):
    runner = bf16.engine.runner
    items = _items([(0, 90), (0, 80)], runner.block_size, runner.num_blocks)
    pad_from = runner.pad_from_rows
    results = {}
    for mode in ("unpadded", "padded"):
        runner.kv_cache.zero_()
        runner.pad_from_rows = None if mode == "unpadded" else pad_from
        logits = runner.execute(runner.prepare(items))
        results[mode] = (logits, runner.kv_cache.clone())
    runner.pad_from_rows = pad_from
    (plain_logits, plain_kv), (padded_logits, padded_kv) = results["unpadded"], results["padded"]
    assert torch.equal(padded_logits.argmax(-1), plain_logits.argmax(-1))
    torch.testing.assert_close(padded_logits, plain_logits, atol=0.15, rtol=0.02)
    # the pad rows wrote nowhere: the same slots hold K/V, and only the sequences' own
    assert torch.equal(padded_kv != 0, plain_kv != 0)
    torch.testing.assert_close(padded_kv.float(), plain_kv.float(), atol=0.05, rtol=0.02)


def test_greedy_answers_keep_through_padded_steps(bf16, monkeypatch):
    prompts = [{"prompt_token_ids": [1] + list(range(300, 300 + length))} for length in (70, 95, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runner = bf16.engine.runner
    padded = [out.outputs[0].token_ids for out in bf16.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(runner, "pad_from_rows", None)
    plain = [out.outputs[0].token_ids for out in bf16.generate(prompts, params, use_tqdm=False)]
    assert padded == plain


def test_attention_leaves_pad_rows_zero():
    torch.manual_seed(0)
    block_size, kv_heads, q_heads, head_dim, tokens, padded = 16, 1, 2, 64, 5, 8
    k_cache = torch.randn(4, block_size, kv_heads, head_dim)
    v_cache = torch.randn(4, block_size, kv_heads, head_dim)
    query = torch.full((padded, q_heads, head_dim), float("nan"))
    query[:tokens] = torch.randn(tokens, q_heads, head_dim)
    meta = build_attention_metadata(torch.tensor([0, tokens], dtype=torch.int32),
                                    torch.tensor([tokens], dtype=torch.int32),
                                    torch.tensor([[0]], dtype=torch.int32), block_size)
    out = paged_attention_cpu(query, k_cache, v_cache, meta, 0.125)
    assert torch.isfinite(out[:tokens]).all()
    assert torch.equal(out[tokens:], torch.zeros(padded - tokens, q_heads, head_dim))
