"""The native CPU prefill kernel (kernels/csrc/paged_prefill.cpp) against the reference, on fresh
random batches: dtypes, GQA ratios, head dims, block sizes, contexts shorter and longer than the
queries, query blocks and key tiles cut short, NaN in every cache slot a sequence does not own,
and an output poisoned with NaN that must be fully written (bf16 at head_dim 64 runs the AMX
form where the CPU has AMX tiles, and with KVRELAY_PREFILL_AMX=0 or at head_dim 128 the
AVX512-BF16 one where the CPU has it; fp32 the FMA one); its refusals; and the SDPA path it replaces, which still runs
where it does not."""
import pytest
import torch

from kvrelay.common import env_switches
from kvrelay.kernels import native_cpu
from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.kernels.attention_reference import paged_attention_reference
from tests.kernels.native_support import on_one_thread_and_more, require_native_decode
from tests.kernels.paged_batch import make_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _prefill_op():
    require_native_decode()
    op = native_cpu.paged_prefill_op()
    assert op is not None, "the prefill kernel is built with the decode kernel"
    return op


def _batch(query_lens, context_lens, block_size=16, num_kv_heads=2, group_size=3, head_dim=64,
           dtype=torch.float32, seed=None, **kwargs):
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh inputs every run
    return make_paged_batch(query_lens, context_lens, block_size, num_kv_heads * group_size,
                            num_kv_heads, head_dim, seed, dtype=dtype, **kwargs)


def _run_native(batch, out=None):
    op = _prefill_op()
    rows = batch.meta.cpu_plan.prefill_rows
    if out is None:
        out = torch.full_like(batch.query, float("nan"))
    op(out, batch.query, batch.k_cache, batch.v_cache, rows.token_starts, rows.query_lens,
       rows.seq_lens, rows.block_tables, batch.scale)
    return out


def _error(batch, out):
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                         batch.scale)
    assert not out.isnan().any(), "a query row was not written, or read an unwritten slot"
    return (out.float() - expected.float()).abs().max().item()


# queries of 18 (just above the decode-row limit), 33 and 70 (query blocks cut short), 130
# (several blocks); contexts of none, a few keys, and more than the queries
QUERY_LENS, CONTEXT_LENS = [18, 33, 70, 130], [0, 5, 100, 47]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_prefill_matches_reference(dtype, block_size, group_size, head_dim):
    batch = _batch(QUERY_LENS, CONTEXT_LENS, block_size, 2, group_size, head_dim, dtype,
                   pad=-1 if group_size % 2 else 0, strided_query=group_size == 3)
    assert _error(batch, _run_native(batch)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_the_bf16_forms_match_the_reference_and_each_other(block_size, group_size, monkeypatch):
    """AMX tiles (the default where the CPU has them) and the AVX512-BF16 pairs form: both round
    the weights to bf16, so they differ only in how the scores' products are summed."""
    batch = _batch(QUERY_LENS, CONTEXT_LENS, block_size, 2, group_size, 64, torch.bfloat16,
                   pad=-1 if group_size % 2 else 0, strided_query=group_size == 3)
    outs = {}
    for amx in ("1", "0"):
        monkeypatch.setenv("KVRELAY_PREFILL_AMX", amx)
        outs[amx] = _run_native(batch)
        assert _error(batch, outs[amx]) <= TOLERANCE[torch.bfloat16]
    assert (outs["1"].float() - outs["0"].float()).abs().max().item() <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("group_size", [2, 4, 6])
def test_native_prefill_takes_every_group_size_it_lists(group_size):
    batch = _batch([40, 19], [3, 0], group_size=group_size, num_kv_heads=1)
    assert _error(batch, _run_native(batch)) <= 1e-4


def test_native_prefill_stays_exact_with_peaked_scores_over_long_rows():
    # Large scores make the running max jump between tiles: every rescale must be right.
    batch = _batch([300, 25], [400, 0], group_size=8, num_kv_heads=1)
    batch.query.mul_(40.0)
    assert _error(batch, _run_native(batch)) <= 1e-4


def test_native_prefill_does_not_depend_on_the_thread_count():
    batch = _batch([90, 40, 200], [0, 60, 10], dtype=torch.bfloat16)
    single, multi = on_one_thread_and_more(lambda: _run_native(batch))
    assert torch.equal(single, multi)  # one thread per work item: same arithmetic either way


def test_native_prefill_writes_only_its_rows_into_a_strided_out():
    batch = _batch([30], [4], num_kv_heads=1)
    wide = torch.full((batch.query.shape[0], 5, 64), 7.0)  # out as a head slice of a wider tensor
    out = _run_native(batch, out=wide[:, 1:4])
    assert _error(batch, out) <= 1e-4
    assert (wide[:, 0] == 7).all() and (wide[:, 4] == 7).all()


def test_native_prefill_rejects_what_would_read_out_of_bounds():
    batch = _batch([20, 30], [0, 5], num_kv_heads=1, group_size=1)
    op = _prefill_op()
    rows = batch.meta.cpu_plan.prefill_rows
    out = torch.empty_like(batch.query)
    args = (out, batch.query, batch.k_cache, batch.v_cache)
    bad_tables = rows.block_tables.clone()
    bad_tables[1, 1] = batch.k_cache.shape[0]  # the second sequence's second block: read
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(*args, rows.token_starts, rows.query_lens, rows.seq_lens, bad_tables, batch.scale)
    too_long = torch.full_like(rows.seq_lens, rows.block_tables.shape[1] * 16 + 1)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        op(*args, rows.token_starts, rows.query_lens, too_long, rows.block_tables, batch.scale)
    with pytest.raises(RuntimeError, match="out of range"):
        op(*args, rows.token_starts + 25, rows.query_lens, rows.seq_lens, rows.block_tables,
           batch.scale)
    with pytest.raises(RuntimeError, match="below its query count"):
        op(*args, rows.token_starts, rows.seq_lens + 1, rows.seq_lens, rows.block_tables,
           batch.scale)
    with pytest.raises(RuntimeError, match="the query's dtype"):
        op(out.bfloat16(), batch.query.bfloat16(), *args[2:], rows.token_starts, rows.query_lens,
           rows.seq_lens, rows.block_tables, batch.scale)


def test_native_prefill_refuses_a_group_it_has_no_kernel_for():
    batch = _batch([24], [0], num_kv_heads=1, group_size=5)
    assert not native_cpu.paged_prefill_supported(64, 5)
    with pytest.raises(RuntimeError, match="q heads per kv head"):
        _run_native(batch)


@pytest.mark.parametrize("head_dim, group_size", [(80, 3), (64, 5)])
def test_shapes_the_kernel_does_not_take_go_through_sdpa(head_dim, group_size):
    _prefill_op()
    batch = _batch([1, 26, 1], [9, 12, 30], head_dim=head_dim, group_size=group_size)
    out = paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert _error(batch, out) <= 1e-4


@pytest.mark.parametrize("switch", ["1", "0"])
def test_decode_and_prefill_rows_of_one_step_with_the_switch_on_and_off(switch, monkeypatch):
    """The environment switch sends prefill sequences back to SDPA; either way a step mixing
    decode rows, draft rows and prefills writes every row right."""
    _prefill_op()
    monkeypatch.setenv(env_switches.NATIVE_CPU_PREFILL.name, switch)
    assert (native_cpu.paged_prefill_op() is None) == (switch == "0")
    batch = _batch([1, 64, 3, 1, 21], [40, 0, 17, 0, 80], dtype=torch.bfloat16)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, out=out)
    assert _error(batch, out) <= TOLERANCE[torch.bfloat16]
