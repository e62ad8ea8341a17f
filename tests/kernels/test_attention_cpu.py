import torch
import pytest
from hypothesis import given, settings, strategies as st

from kvrelay.kernels import cpu_decode_torch, native_cpu
from kvrelay.kernels.dispatch import paged_attention
from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.kernels.attention_reference import paged_attention_reference
from tests.kernels.attention_cases import ATTENTION_ARGS, ATTENTION_CASES, case_seed
from tests.kernels.native_support import require_native_decode
from tests.kernels.paged_batch import make_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Runs a test's decode rows through the native kernel, then through the torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(native_cpu, "paged_decode_op", lambda: None)
    else:
        require_native_decode()
    return request.param


def _check_cpu_path(batch, tolerance):
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = torch.full_like(batch.query, float("nan"))  # every element must be written
    returned = paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, out=out)
    assert returned is out
    assert not out.isnan().any()
    assert (out.float() - expected.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(ATTENTION_ARGS, ATTENTION_CASES)
def test_cpu_path_matches_reference(
    query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim, dtype, decode_path
):
    seed = case_seed(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim) + 1
    batch = make_paged_batch(
        query_lens, context_lens, block_size, num_kv_heads * group_size, num_kv_heads, head_dim, seed,
        dtype=dtype, pad=-1 if seed % 2 else 0, strided_query=seed % 3 == 0,
    )
    _check_cpu_path(batch, TOLERANCE[dtype])


def test_torch_decode_path_batches_many_decode_rows_in_length_groups(monkeypatch):
    # A small group budget splits the decode rows into several length groups.
    monkeypatch.setattr(native_cpu, "paged_decode_op", lambda: None)
    monkeypatch.setattr(cpu_decode_torch, "DECODE_GROUP_KEY_TOKENS", 256)
    generator = torch.Generator().manual_seed(7)
    num_decode = 40
    context_lens = torch.randint(0, 90, (num_decode,), generator=generator).tolist()
    batch = make_paged_batch(
        [1] * num_decode + [9, 4], context_lens + [0, 30], 16, 9, 3, 64, seed=11
    )
    _check_cpu_path(batch, 1e-4)
    assert len(batch.meta.cpu_plan.padded_decode_groups) > 1


def test_dispatch_uses_cpu_path_and_allocates_out():
    batch = make_paged_batch([1, 5], [10, 3], 16, 6, 2, 64, seed=3)
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.shape == batch.query.shape
    assert (out - expected).abs().max().item() <= 1e-4


@st.composite
def _random_batches(draw):
    num_seqs = draw(st.integers(1, 6))
    query_lens = draw(st.lists(st.sampled_from([1, 1, 1, 2, 5, 17, 33]), min_size=num_seqs, max_size=num_seqs))
    context_lens = draw(st.lists(st.integers(0, 70), min_size=num_seqs, max_size=num_seqs))
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_kv_heads = draw(st.integers(1, 3))
    group_size = draw(st.sampled_from([1, 3, 8]))
    head_dim = draw(st.sampled_from([64, 128]))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_paged_batch(
        query_lens, context_lens, block_size, num_kv_heads * group_size, num_kv_heads, head_dim, seed
    )


@settings(max_examples=40, deadline=None)
@given(_random_batches())
def test_cpu_path_matches_reference_on_random_batches(batch):
    _check_cpu_path(batch, 1e-4)
