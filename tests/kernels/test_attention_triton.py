import torch
import pytest
from hypothesis import assume, given, settings, strategies as st

from kvrelay.kernels.attention_reference import paged_attention_reference
from kvrelay.kernels.triton_paged_attention import paged_attention_triton
from tests.kernels.attention_cases import ATTENTION_ARGS, ATTENTION_CASES, case_seed
from tests.kernels.paged_batch import make_paged_batch


def _run_triton(batch):
    out = torch.full_like(batch.query, float("nan"))  # every element must be written
    returned = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, out=out)
    assert returned is out
    return out


@pytest.mark.parametrize(ATTENTION_ARGS, ATTENTION_CASES)
def test_triton_matches_reference_fp32(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim):
    seed = case_seed(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim)
    batch = make_paged_batch(
        query_lens, context_lens, block_size, num_kv_heads * group_size, num_kv_heads, head_dim, seed,
        pad=-1 if seed % 2 else 0, strided_query=seed % 3 == 0,
    )
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = _run_triton(batch)
    assert not out.isnan().any()
    assert (out - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ATTENTION_ARGS,
    [
        pytest.param([1, 9, 1], [21, 7, 0], 16, 1, 3, 64, id="mixed-g3"),
        pytest.param([4, 1], [30, 12], 32, 1, 8, 128, id="chunked-g8"),
    ],
)
def test_triton_matches_reference_bf16(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim):
    seed = case_seed(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim)
    batch = make_paged_batch(
        query_lens, context_lens, block_size, num_kv_heads * group_size, num_kv_heads, head_dim, seed,
        dtype=torch.bfloat16,
    )
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = _run_triton(batch)
    assert out.dtype == torch.bfloat16
    assert not out.isnan().any()
    assert (out.float() - expected.float()).abs().max().item() <= 2e-2


@settings(max_examples=15, deadline=None)
@given(
    query_lens=st.lists(st.sampled_from([0, 1, 1, 1, 2, 7, 21]), min_size=1, max_size=4),
    context_seed=st.integers(0, 2**31 - 1),
    block_size=st.sampled_from([16, 32]),
    num_kv_heads=st.integers(1, 2),
    group_size=st.sampled_from([1, 3, 8]),
    head_dim=st.sampled_from([64, 128]),
)
def test_triton_matches_reference_on_random_batches(
    query_lens, context_seed, block_size, num_kv_heads, group_size, head_dim
):
    assume(sum(query_lens) > 0)
    generator = torch.Generator().manual_seed(context_seed)
    context_lens = torch.randint(0, 50, (len(query_lens),), generator=generator).tolist()
    context_lens = [max(c, 1 - q) for q, c in zip(query_lens, context_lens)]  # no empty sequences
    batch = make_paged_batch(
        query_lens, context_lens, block_size, num_kv_heads * group_size, num_kv_heads, head_dim, context_seed
    )
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = _run_triton(batch)
    assert not out.isnan().any()
    assert (out - expected).abs().max().item() <= 1e-4
