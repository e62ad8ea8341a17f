import torch
import pytest

from kvrelay.kernels import native_cpu
from kvrelay.kernels.dispatch import store_kv
from kvrelay.kernels.store_kv_torch import store_kv_cpu, store_kv_reference
from kvrelay.kernels.triton_store_kv import store_kv_triton
from tests.kernels.native_support import require_native_decode

STORE_CASES = [
    # (num_tokens, num_blocks, block_size, num_kv_heads, head_dim)
    pytest.param(5, 4, 16, 1, 64, id="bs16-h1-d64"),
    pytest.param(21, 6, 16, 3, 64, id="bs16-h3-d64"),
    pytest.param(9, 3, 32, 2, 128, id="bs32-h2-d128"),
    pytest.param(13, 5, 8, 5, 80, id="bs8-h5-d80"),
]


def _store_inputs(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    # Distinct random slots, some of them marked as skipped with a negative slot.
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    skipped = torch.rand(num_tokens, generator=generator) < 0.3
    slot_mapping[skipped] = -1
    # key/value as head slices of one wider tensor, as they come out of a fused qkv projection.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    return key, value, k_cache, v_cache, slot_mapping


def _assert_stored(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        written[block, offset] = True
        assert torch.equal(k_cache[block, offset], key[token])
        assert torch.equal(v_cache[block, offset], value[token])
    # Skipped tokens and untouched slots leave the cache as it was.
    assert k_cache[~written].isnan().all() and v_cache[~written].isnan().all()


@pytest.mark.parametrize("store", [store_kv_reference, store_kv_cpu, store_kv, store_kv_triton])
@pytest.mark.parametrize("num_tokens, num_blocks, block_size, num_kv_heads, head_dim", STORE_CASES)
def test_store_writes_only_kept_slots(store, num_tokens, num_blocks, block_size, num_kv_heads, head_dim):
    seed = num_tokens * 1009 + block_size * 31 + head_dim
    key, value, k_cache, v_cache, slot_mapping = _store_inputs(
        num_tokens, num_blocks, block_size, num_kv_heads, head_dim, seed
    )
    assert (slot_mapping < 0).any()
    store(key, value, k_cache, v_cache, slot_mapping)
    _assert_stored(key, value, k_cache, v_cache, slot_mapping)


@pytest.mark.parametrize("store", [store_kv_cpu, store_kv_triton])
def test_store_matches_reference_bf16(store):
    inputs = _store_inputs(11, 4, 16, 3, 64, seed=5, dtype=torch.bfloat16)
    expected_k, expected_v = inputs[2].clone(), inputs[3].clone()
    store_kv_reference(inputs[0], inputs[1], expected_k, expected_v, inputs[4])
    store(*inputs)
    assert torch.equal(inputs[2].nan_to_num(), expected_k.nan_to_num())
    assert torch.equal(inputs[3].isnan(), expected_v.isnan())


@pytest.mark.parametrize("store", [store_kv_cpu, store_kv_triton])
def test_store_without_skipped_tokens_and_empty_batch(store):
    key, value, k_cache, v_cache, slot_mapping = _store_inputs(7, 2, 16, 2, 64, seed=9)
    slot_mapping = torch.arange(3, 10)
    store(key, value, k_cache, v_cache, slot_mapping)
    _assert_stored(key, value, k_cache, v_cache, slot_mapping)
    store(key[:0], value[:0], k_cache, v_cache, slot_mapping[:0])
    _assert_stored(key, value, k_cache, v_cache, slot_mapping)


def _torch_store(monkeypatch):
    """store_kv_cpu as it runs where the native extension is off or failed to build."""
    monkeypatch.setattr(native_cpu, "store_kv_op", lambda: None)
    return store_kv_cpu


@pytest.mark.parametrize("num_tokens, num_blocks, block_size, num_kv_heads, head_dim", STORE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_torch_stores_agree(monkeypatch, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    require_native_decode()
    assert native_cpu.store_kv_op() is not None
    inputs = _store_inputs(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, seed=num_tokens, dtype=dtype)
    native_k, native_v = inputs[2].clone(), inputs[3].clone()
    store_kv_cpu(inputs[0], inputs[1], native_k, native_v, inputs[4])
    _assert_stored(inputs[0], inputs[1], native_k, native_v, inputs[4])
    _torch_store(monkeypatch)(*inputs)
    assert torch.equal(native_k.isnan(), inputs[2].isnan()) and torch.equal(native_v.isnan(), inputs[3].isnan())
    assert torch.equal(native_k.nan_to_num(), inputs[2].nan_to_num())
    assert torch.equal(native_v.nan_to_num(), inputs[3].nan_to_num())


def test_torch_store_converts_dtype_and_skips(monkeypatch):
    key, value, k_cache, v_cache, slot_mapping = _store_inputs(13, 4, 16, 3, 64, seed=3)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    # fp32 rows into a bf16 cache: the torch path (the native store takes one dtype), with or
    # without the extension.
    for store in (store_kv_cpu, _torch_store(monkeypatch)):
        store(key, value, k_cache, v_cache, slot_mapping)
        _assert_stored(key.to(torch.bfloat16), value.to(torch.bfloat16), k_cache, v_cache, slot_mapping)


def test_native_store_rejects_a_slot_outside_the_cache():
    require_native_decode()
    key, value, k_cache, v_cache, slot_mapping = _store_inputs(5, 2, 16, 1, 64, seed=1)
    slot_mapping[0] = 2 * 16
    with pytest.raises(RuntimeError, match="outside the cache"):
        native_cpu.store_kv_op()(key, value, k_cache, v_cache, slot_mapping)
