"""8-bit KV cache rows (kernels/kv_quant.py): the codes' error bound per format, the native store
against the torch reference bit for bit, and every attention path (native decode and prefill,
the torch fallbacks) reading 8-bit rows against the reference on the same rows."""
import pytest
import torch

from kvrelay.common import env_switches
from kvrelay.kernels import kv_quant, native_cpu
from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.kernels.attention_reference import paged_attention_reference
from kvrelay.kernels.store_kv_torch import store_kv_cpu, store_kv_reference
from tests.kernels.native_support import require_native_decode
from tests.kernels.paged_batch import make_paged_batch

FORMATS = list(kv_quant.FORMATS)
# Largest |dequantized - x| per row, as a fraction of the row's max |x|: int8 rounds to 1/254 of
# it; fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits, half an ulp relative to each value.
ROW_ERROR = {"int8": 0.5 / 127 * 1.001, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


def _rows(seed, shape=(37, 3, 64), dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(shape, generator=generator) * torch.rand(shape[:-1] + (1,), generator=generator) * 8
    rows[0, 0] = 0.0  # an all-zero row: scale 0, codes 0
    return rows.to(dtype)


@pytest.mark.parametrize("name", FORMATS)
def test_codes_stay_within_the_formats_bound(name):
    fmt = kv_quant.FORMATS[name]
    rows = _rows(1)
    coded = kv_quant.quantize_rows(rows, fmt)
    assert coded.dtype == fmt.dtype and coded.shape == (37, 3, 68)
    restored = kv_quant.dequantize_rows(coded)
    # The bound holds per element in the rotated frame, where the codes are (dequantize_rows
    # rotates back; rotating again undoes that up to float32 rounding).
    rotated, restored_rotated = kv_quant.rotate(rows), kv_quant.rotate(restored)
    largest = rotated.abs().amax(-1, keepdim=True)
    error = (restored_rotated - rotated).abs() / largest.clamp(min=1e-30)
    assert error.max() <= ROW_ERROR[name] + 1e-5
    assert torch.equal(restored[0, 0], torch.zeros(64))
    # the row's largest value is a code's largest value times the scale: kept nearly exactly
    assert torch.allclose(restored_rotated.abs().amax(-1), largest[..., 0], rtol=1e-5)
    # and as a whole the row is as close as its rotated form (H is orthonormal)
    assert torch.allclose((restored - rows).norm(dim=-1), (restored_rotated - rotated).norm(dim=-1),
                          rtol=1e-3, atol=1e-5)


def test_names_parse_as_vllm_spells_them():
    assert kv_quant.parse("auto") is None
    assert kv_quant.parse("fp8") is kv_quant.FORMATS["fp8_e4m3"]
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'"):
        kv_quant.parse("fp4")


def _caches(fmt, num_blocks=6, block_size=16, heads=3, head_dim=64):
    shape = (num_blocks, block_size, heads, head_dim + kv_quant.SCALE_BYTES)
    return [torch.zeros(shape, dtype=torch.uint8).view(fmt.dtype) for _ in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FORMATS)
def test_native_store_codes_rows_as_the_reference_does(name, dtype):
    require_native_decode()
    fmt = kv_quant.FORMATS[name]
    keys, values = _rows(2, (20, 3, 64), dtype), _rows(3, (20, 3, 64), dtype)
    # a row whose rotation spans nine decades (H undoes itself): its codes reach down among the
    # fp8 subnormals, in float32 at least (bf16 rounding blurs the small ones)
    decades = 10.0 ** -torch.linspace(0, 9, 64) * torch.tensor([1.0, -1.0]).repeat(32)
    keys[1, 1] = kv_quant.rotate(decades).to(dtype)
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(4))[:20]
    slots[5] = -1  # skipped (a padding row)
    k_native, v_native, k_ref, v_ref = _caches(fmt)
    store_kv_cpu(keys, values, k_native, v_native, slots)
    store_kv_reference(keys, values, k_ref, v_ref, slots)
    assert torch.equal(k_native.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_native.view(torch.uint8), v_ref.view(torch.uint8))
    assert k_native.view(torch.uint8).view(-1, 3, 68)[slots[5].abs()].any() == (slots[5].abs() in slots)


def _attention_error(batch, out):
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert not out.isnan().any()
    return (out.float() - expected.float()).abs().max().item()


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("head_dim,group_size", [(64, 3), (128, 1), (64, 8), (80, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FORMATS)
def test_native_decode_reads_8bit_rows(name, dtype, head_dim, group_size):
    op = require_native_decode()
    batch = make_paged_batch([1] * 5, [0, 14, 15, 40, 90], 16, 2 * group_size, 2, head_dim, seed=head_dim + group_size,
                             dtype=dtype, kv_format=name)
    rows = batch.meta.cpu_plan.decode
    out = torch.full_like(batch.query, float("nan"))
    op(out, batch.query, batch.k_cache, batch.v_cache, rows.token_ids, rows.seq_lens, rows.block_tables,
       batch.scale, 0, 0.0)
    assert _attention_error(batch, out) <= TOLERANCE[dtype]


@pytest.mark.parametrize("window,soft_cap", [(0, 0.0), (20, 0.0), (0, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FORMATS)
def test_native_prefill_reads_8bit_rows(name, dtype, window, soft_cap):
    require_native_decode()
    if native_cpu.paged_prefill_op() is None:
        pytest.skip("the native prefill kernel is switched off")
    batch = make_paged_batch([40, 7, 1], [0, 25, 60], 16, 6, 2, 64, seed=7, dtype=dtype, kv_format=name,
                             window=window)
    out = paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                              soft_cap=soft_cap)
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                         soft_cap=soft_cap)
    assert (out.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("soft_cap", [0.0, 30.0])
@pytest.mark.parametrize("name", FORMATS)
def test_torch_paths_read_8bit_rows(name, soft_cap, monkeypatch):
    """Where the native kernels are off, the torch decode and SDPA prefill dequantize the rows
    they gather."""
    monkeypatch.setenv(env_switches.NATIVE_CPU_ATTENTION.name, "0")
    native_cpu.paged_decode_op.cache_clear()
    try:
        assert native_cpu.paged_decode_op() is None
        batch = make_paged_batch([1, 1, 30], [5, 50, 20], 16, 6, 2, 64, seed=11, kv_format=name)
        out = paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                  soft_cap=soft_cap)
        expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                             soft_cap=soft_cap)
        assert (out - expected).abs().max().item() <= 1e-4
    finally:
        native_cpu.paged_decode_op.cache_clear()


@pytest.mark.parametrize("name", FORMATS)
def test_attention_on_8bit_rows_stays_near_the_float_cache(name):
    """What coding costs the attention output on random rows: bounded by the format's error."""
    coded = make_paged_batch([1, 1, 20], [30, 90, 10], 16, 6, 2, 64, seed=13, kv_format=name)
    plain = make_paged_batch([1, 1, 20], [30, 90, 10], 16, 6, 2, 64, seed=13)
    out = paged_attention_cpu(coded.query, coded.k_cache, coded.v_cache, coded.meta, coded.scale)
    expected = paged_attention_reference(plain.query, plain.k_cache, plain.v_cache, plain.meta, plain.scale)
    bound = {"int8": 0.02, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3}[name]
    assert (out - expected).abs().max().item() <= bound


@pytest.mark.parametrize("head_dim", [64, 128, 80, 96])
def test_rotation_is_an_orthonormal_involution(head_dim):
    rows = torch.randn(7, 2, head_dim)
    rotated = kv_quant.rotate(rows)
    assert torch.allclose(rotated.norm(dim=-1), rows.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(kv_quant.rotate(rotated), rows, atol=1e-5)
    block = kv_quant.rotation_block(head_dim)
    # each row's result is its own: the same row beside others rotates to the same bits
    assert torch.equal(kv_quant.rotate(rows[3:4]), rotated[3:4])
    assert block == {64: 64, 128: 128, 80: 16, 96: 32}[head_dim]


def test_rotation_spreads_an_outlier_dimension():
    rows = torch.randn(64, 64) * 0.1
    rows[:, 5] = 8.0  # one dimension far above the rest, as some of a model's key dimensions are
    fmt = kv_quant.FORMATS["int8"]
    error = (kv_quant.dequantize_rows(kv_quant.quantize_rows(rows, fmt)) - rows).norm(dim=-1)
    unrotated = kv_quant.dequantize_rows(kv_quant.code_rotated_rows(rows, fmt))
    unrotated = kv_quant.rotate(unrotated)  # dequantize_rows rotates back what it reads
    assert error.mean() < 0.5 * (unrotated - rows).norm(dim=-1).mean()


@pytest.mark.parametrize("window,soft_cap", [(0, 0.0), (12, 30.0)])
@pytest.mark.parametrize("name", FORMATS)
def test_triton_reads_8bit_rows(name, window, soft_cap):
    """The Triton kernel (here in its CPU interpreter) decodes each row's codes and scale in its
    tiles and rotates queries in and outputs out, as the native kernels do."""
    from kvrelay.kernels.triton_paged_attention import paged_attention_triton
    batch = make_paged_batch([1, 9, 1], [21, 7, 0], 16, 6, 2, 64, seed=17, kv_format=name, window=window)
    out = torch.full_like(batch.query, float("nan"))
    returned = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                      out=out, soft_cap=soft_cap)
    assert returned is out
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                         soft_cap=soft_cap)
    assert (out - expected).abs().max().item() <= 1e-4
