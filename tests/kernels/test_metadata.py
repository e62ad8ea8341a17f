import subprocess
import sys
from pathlib import Path

import torch
import pytest

from kvrelay.kernels import cpu_decode_torch
from kvrelay.kernels.metadata import build_attention_metadata


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_metadata_computes_maxima_and_splits_decode_from_prefill():
    # Rows: decode, prefill without context, decode, chunked prefill with context.
    meta = build_attention_metadata(
        _int32([0, 1, 21, 22, 40]), _int32([9, 20, 40, 40]), torch.zeros(4, 3, dtype=torch.int32), block_size=16
    )
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.num_seqs) == (20, 40, 4)
    plan = meta.cpu_plan
    assert plan.decode.token_ids.tolist() == [0, 21]
    assert plan.decode.seq_lens.tolist() == [9, 40]
    assert plan.decode.block_tables.dtype == torch.int32 and plan.decode.block_tables.shape == (2, 3)
    assert plan.padded_decode_groups is None  # built only by the torch decode path, on first use
    assert [(p.token_start, p.query_len) for p in plan.prefills] == [(1, 20), (22, 18)]
    assert plan.prefills[0].causal_mask is None  # no context: SDPA's own causal mask
    assert plan.prefills[1].causal_mask.shape == (18, 40)


def test_a_few_query_tokens_become_causal_decode_rows():
    # A speculative step: 1 + 3 queries over 12 keys, beside a plain decode row.
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    meta = build_attention_metadata(_int32([0, 4, 5]), _int32([12, 7]), tables, block_size=16)
    plan = meta.cpu_plan
    assert plan.prefills == []
    assert plan.decode.token_ids.tolist() == [0, 1, 2, 3, 4]
    assert plan.decode.seq_lens.tolist() == [9, 10, 11, 12, 7]  # each sees up to itself
    assert plan.decode.block_tables.tolist() == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]]


def test_pure_decode_step_hands_the_kernel_its_own_tensors():
    # The common step: every row decodes, so planning must not copy the tables per step.
    seq_lens, block_tables = _int32([3, 17, 40]), torch.zeros(3, 4, dtype=torch.int32)
    meta = build_attention_metadata(torch.arange(4, dtype=torch.int32), seq_lens, block_tables, 16)
    decode = meta.cpu_plan.decode
    assert decode.token_ids.tolist() == [0, 1, 2] and decode.token_ids.dtype == torch.int64
    assert decode.seq_lens.data_ptr() == seq_lens.data_ptr()
    assert decode.block_tables.data_ptr() == block_tables.data_ptr()
    assert meta.cpu_plan.prefills == []


def test_decode_groups_cover_each_row_once_within_budget(monkeypatch):
    monkeypatch.setattr(cpu_decode_torch, "DECODE_GROUP_KEY_TOKENS", 100)
    seq_lens = [40, 7, 33, 90, 150, 12, 25, 60]  # 150 alone exceeds the budget
    meta = build_attention_metadata(
        torch.arange(len(seq_lens) + 1, dtype=torch.int32), _int32(seq_lens), torch.zeros(8, 10, dtype=torch.int32), 16
    )
    plan = meta.cpu_plan
    groups = cpu_decode_torch.plan_decode_groups(plan.decode, plan.block_size)
    assert sorted(t for group in groups for t in group.token_ids.tolist()) == list(range(len(seq_lens)))
    for group in groups:
        rows = group.token_ids.numel()
        assert group.max_len == max(seq_lens[t] for t in group.token_ids.tolist())
        assert rows == 1 or rows * group.max_len <= 100
        assert group.key_mask.shape == (rows, 1, 1, group.max_len)


def test_metadata_keeps_given_maxima():
    meta = build_attention_metadata(
        _int32([0, 1]), _int32([3]), torch.zeros(1, 1, dtype=torch.int32), 16, max_seqlen_q=1, max_seqlen_k=64
    )
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (1, 64)


def test_metadata_rejects_mismatched_shapes_and_short_sequences():
    with pytest.raises(ValueError):
        build_attention_metadata(_int32([0, 1, 2]), _int32([3]), torch.zeros(1, 1, dtype=torch.int32), 16)
    with pytest.raises(ValueError):
        build_attention_metadata(_int32([0, 4]), _int32([3]), torch.zeros(1, 1, dtype=torch.int32), 16)


def test_kernels_import_and_run_on_cpu_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from kvrelay.kernels.dispatch import paged_attention, store_kv\n"
        "from kvrelay.kernels.metadata import build_attention_metadata\n"
        "meta = build_attention_metadata(torch.tensor([0, 1], dtype=torch.int32),"
        " torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 16)\n"
        "cache = torch.zeros(1, 16, 1, 64)\n"
        "store_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), cache, cache, torch.tensor([0]))\n"
        "out = paged_attention(torch.ones(1, 1, 64), cache, cache, meta, 0.125)\n"
        "assert torch.allclose(out, torch.ones(1, 1, 64))\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
