"""The native CPU kernels' own forms under a sliding window and a soft cap, called directly: the
fixed-shape and generic decode kernels, bf16 rows cut into parts, a verify step's runs on the
prefill kernel, the prefill kernel's fp32, AVX512-BF16 and AMX forms (each where the CPU has it);
against the reference, on fresh random inputs, with block-table entries before the window
pointing outside the cache (a read would be refused)."""
import pytest
import torch

from kvrelay.kernels import native_cpu
from tests.kernels.native_support import on_one_thread_and_more, require_native_decode
from tests.kernels.window_cases import TOLERANCE, max_error, poisoned_meta, reference, window_batch


def _decode(batch, soft_cap, meta=None):
    op = require_native_decode()
    meta = meta or batch.meta
    rows = meta.cpu_plan.decode
    out = torch.full_like(batch.query, float("nan"))
    op(out, batch.query, batch.k_cache, batch.v_cache, rows.token_ids, rows.seq_lens, rows.block_tables,
       batch.scale, meta.window, soft_cap)
    return out


def _decode_one_row_at_a_time(batch, soft_cap):
    op = require_native_decode()
    rows = batch.meta.cpu_plan.decode
    out = torch.full_like(batch.query, float("nan"))
    for row in range(rows.num_rows):
        pick = slice(row, row + 1)
        op(out, batch.query, batch.k_cache, batch.v_cache, rows.token_ids[pick], rows.seq_lens[pick],
           rows.block_tables[pick].contiguous(), batch.scale, batch.meta.window, soft_cap)
    return out


def _prefill(batch, soft_cap, meta=None):
    require_native_decode()
    op = native_cpu.paged_prefill_op()
    meta = meta or batch.meta
    rows = meta.cpu_plan.prefill_rows
    out = torch.full_like(batch.query, float("nan"))
    op(out, batch.query, batch.k_cache, batch.v_cache, rows.token_starts, rows.query_lens, rows.seq_lens,
       rows.block_tables, batch.scale, meta.window, soft_cap)
    return out


# First token, around a block edge, several blocks, long.
DECODE_CONTEXTS = [0, 14, 15, 16, 90, 300]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [1, 16, 37, 1000])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the generic kernel
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_decode_forms(dtype, group_size, head_dim, window, soft_cap):
    batch = window_batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, 16, 2, group_size, head_dim, window=window,
                         soft_cap=soft_cap, dtype=dtype)
    expected = reference(batch, soft_cap)
    assert max_error(_decode(batch, soft_cap), expected) <= TOLERANCE[dtype]
    if window < 1000:
        assert max_error(_decode(batch, soft_cap, poisoned_meta(batch, "out-of-range")), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [65, 300])
def test_bf16_rows_cut_into_parts_see_only_their_window(window, soft_cap, monkeypatch):
    # One or two rows of a few kv heads: the bf16 decode kernel cuts each row's visible keys into
    # parts, attends them apart and merges them; the 3-key row has parts with no key.
    batch = window_batch([1, 1], [700, 2], 16, 1, 8, 64, window=window, soft_cap=soft_cap, dtype=torch.bfloat16)
    expected = reference(batch, soft_cap)
    poisoned = poisoned_meta(batch, "out-of-range")
    for split in ("1", "0"):
        monkeypatch.setenv("KVRELAY_DECODE_SPLIT", split)
        assert max_error(_decode(batch, soft_cap), expected) <= TOLERANCE[torch.bfloat16]
        assert max_error(_decode(batch, soft_cap, poisoned), expected) <= TOLERANCE[torch.bfloat16]
    single, multi = on_one_thread_and_more(lambda: _decode(batch, soft_cap))
    assert torch.equal(single, multi)


# A verify step: runs of 1 + drafts rows, the longest of 17, one lone row.
VERIFY_QUERY_LENS, VERIFY_CONTEXTS = [5, 1, 3, 17, 2], [40, 70, 13, 100, 33]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [1, 10, 37])
@pytest.mark.parametrize("head_dim, group_size", [(64, 3), (128, 8), (64, 1)])
def test_bf16_verify_runs_on_the_prefill_kernel_keep_the_window(head_dim, group_size, window, soft_cap):
    batch = window_batch(VERIFY_QUERY_LENS, VERIFY_CONTEXTS, 16, 2, group_size, head_dim, window=window,
                         soft_cap=soft_cap, dtype=torch.bfloat16)
    expected = reference(batch, soft_cap)
    together = _decode(batch, soft_cap)
    assert max_error(together, expected) <= TOLERANCE[torch.bfloat16]
    assert max_error(_decode_one_row_at_a_time(batch, soft_cap), together) <= TOLERANCE[torch.bfloat16]
    poisoned = poisoned_meta(batch, "out-of-range")
    assert max_error(_decode(batch, soft_cap, poisoned), expected) <= TOLERANCE[torch.bfloat16]


def test_fp32_verify_rows_stay_what_plain_decode_computes_under_a_window():
    batch = window_batch(VERIFY_QUERY_LENS, VERIFY_CONTEXTS, 16, 3, 3, 64, window=21, soft_cap=5.0)
    together = _decode(batch, 5.0)
    assert max_error(together, reference(batch, 5.0)) <= TOLERANCE[torch.float32]
    assert torch.equal(together, _decode_one_row_at_a_time(batch, 5.0))


# Queries of 18 (just above the decode-row limit) to 130 (several query blocks), contexts of none
# to more than the queries.
PREFILL_QUERY_LENS, PREFILL_CONTEXTS = [18, 33, 70, 130], [0, 5, 100, 47]


@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", [1, 16, 37, 80])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("dtype, amx", [(torch.float32, "1"), (torch.bfloat16, "1"), (torch.bfloat16, "0")],
                         ids=["fp32", "bf16-amx-if-any", "bf16-no-amx"])
def test_native_prefill_forms(dtype, amx, group_size, head_dim, window, soft_cap, monkeypatch):
    monkeypatch.setenv("KVRELAY_PREFILL_AMX", amx)
    batch = window_batch(PREFILL_QUERY_LENS, PREFILL_CONTEXTS, 8, 2, group_size, head_dim, window=window,
                         soft_cap=soft_cap, dtype=dtype)
    expected = reference(batch, soft_cap)
    assert max_error(_prefill(batch, soft_cap), expected) <= TOLERANCE[dtype]
    assert max_error(_prefill(batch, soft_cap, poisoned_meta(batch, "out-of-range")), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_peaked_scores_under_a_window_and_a_cap(dtype):
    # Large scores make the running max jump between tiles; the cap holds them at +-cap.
    for soft_cap in (0.0, 30.0):
        batch = window_batch([1, 1, 200, 40], [700, 40, 300, 0], 16, 1, 8, 64, window=150, soft_cap=soft_cap,
                             dtype=dtype)
        batch.query.mul_(40.0)
        expected = reference(batch, soft_cap)
        out = _prefill(batch, soft_cap)
        decoded = _decode(batch, soft_cap)
        for row in batch.meta.cpu_plan.decode.token_ids.tolist():
            out[row] = decoded[row]
        assert max_error(out, expected) <= TOLERANCE[dtype]


def test_native_ops_refuse_a_negative_window_or_cap():
    batch = window_batch([1], [20], 16, 1, 1, 64, window=0, soft_cap=0.0)
    op = require_native_decode()
    rows = batch.meta.cpu_plan.decode
    args = (torch.empty_like(batch.query), batch.query, batch.k_cache, batch.v_cache, rows.token_ids,
            rows.seq_lens, rows.block_tables, batch.scale)
    with pytest.raises(RuntimeError, match="window"):
        op(*args, -1, 0.0)
    with pytest.raises(RuntimeError, match="soft_cap"):
        op(*args, 0, -2.0)


def test_a_bad_block_inside_the_window_is_still_refused():
    # Only what lies before the window is skipped: an entry the window reads is checked as ever.
    batch = window_batch([1, 30], [90, 60], 16, 1, 3, 64, window=40, soft_cap=0.0)
    for run, rows in ((_decode, batch.meta.cpu_plan.decode), (_prefill, batch.meta.cpu_plan.prefill_rows)):
        rows.block_tables[:, 4] = batch.k_cache.shape[0]  # keys 64-79: in both windows
        with pytest.raises(RuntimeError, match="outside the cache"):
            run(batch, 0.0)
