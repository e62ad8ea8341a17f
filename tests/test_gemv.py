"""Small-step matmuls on AVX512-BF16 (kernels/native_gemv.py) against the float32 product of the
same weights on fresh random inputs: the 4-bit kernel on the checkpoint's blocks (Q4_0, Q4_1),
the 8-bit kernel on Q8_0 blocks (a head's), the bf16 kernel on the head's tiles, and the
refusals. The engine's greedy tokens on these
kernels are checked in test_int4_weights.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from kvrelay.kernels import native_amx, native_gemv
from kvrelay.engine.models import gguf_int4, gguf_q8_head

pytestmark = pytest.mark.skipif(native_gemv.gemv_ops() is None, reason="no AVX512-BF16 here")

# around the kernel's passes of up to 3 rows
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7)


def q4_blocks(kind: str, out_features: int, in_features: int) -> gguf_int4.Q4Blocks:
    rng = np.random.default_rng()
    raw = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05,
                   GGMLQuantizationType[kind])
    return gguf_int4.unpack_blocks(kind, raw, in_features)


def assert_close_to_rounded(got: torch.Tensor, reference: torch.Tensor) -> None:
    """float32 accumulation and one rounding to bf16 (at most an ulp, 2^-8 of the value),
    nothing more: the 4-bit kernel's scaling of sums instead of weights costs no precision."""
    assert got.dtype == torch.bfloat16 and got.shape == reference.shape
    excess = (got.float() - reference).abs() - 2 ** -8 * reference.abs()
    assert excess.max().item() <= 1e-5 * reference.abs().max().item()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(16, 32), (96, 576), (576, 1536)])
def test_4_bit_kernel_matches_the_float32_product_of_the_dequantized_weights(kind, shape):
    ops = native_gemv.gemv_ops()
    blocks = q4_blocks(kind, *shape)
    tiles = native_amx.pack_q4(blocks.q, blocks.scale, blocks.zero)
    weight = blocks.dequantized()  # [N, K] float32, as the checkpoint's copy
    for rows in ROW_COUNTS:
        x = torch.randn(rows, shape[1]).bfloat16()
        assert_close_to_rounded(native_gemv.matmul_q4(ops, x, tiles), x.float() @ weight.T)


def q8_blocks(out_features: int, in_features: int) -> gguf_q8_head.Q8Blocks:
    rng = np.random.default_rng()
    raw = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05,
                   GGMLQuantizationType.Q8_0)
    return gguf_q8_head.unpack_q8_0(raw, in_features)


@pytest.mark.parametrize("shape", [(16, 32), (96, 576), (4096, 576)])
def test_8_bit_kernel_matches_the_float32_product_of_the_dequantized_weights(shape):
    ops = native_gemv.gemv_ops()
    blocks = q8_blocks(*shape)
    tiles = native_gemv.pack_q8(blocks.q, blocks.d)
    weight = blocks.dequantized()
    for rows in ROW_COUNTS:
        x = torch.randn(rows, shape[1]).bfloat16()
        assert_close_to_rounded(native_gemv.matmul_q8(ops, x, tiles), x.float() @ weight.T)


def test_q8_0_blocks_unpack_to_what_gguf_dequantizes():
    rng = np.random.default_rng()
    raw = quantize(rng.standard_normal((48, 128)).astype(np.float32), GGMLQuantizationType.Q8_0)
    blocks = gguf_q8_head.unpack_q8_0(raw, 128)
    np.testing.assert_array_equal(blocks.dequantized().numpy(),
                                  dequantize(raw, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("shape", [(16, 32), (4096, 576)])
def test_bf16_kernel_matches_the_float32_product(shape):
    ops = native_gemv.gemv_ops()
    weight = (torch.randn(*shape) * 0.05).bfloat16()
    packed = native_amx.pack_bf16(weight)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, shape[1]).bfloat16()
        assert_close_to_rounded(native_gemv.matmul_bf16(ops, x, packed),
                                x.float() @ weight.float().T)


def test_mismatched_weights_and_shapes_are_refused():
    ops = native_gemv.gemv_ops()
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gemv_bf16(torch.empty(1, 16, dtype=torch.bfloat16),
                      torch.ones(1, 48, dtype=torch.bfloat16),
                      torch.ones(16 * 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.gemv_q4(torch.empty(1, 16, dtype=torch.bfloat16), x,
                    torch.zeros(320, dtype=torch.uint8))  # one tile where two are needed
    with pytest.raises(RuntimeError, match="8-bit weight does not match"):
        ops.gemv_q8(torch.empty(1, 16, dtype=torch.bfloat16), x,
                    torch.zeros(544, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="bf16"):
        ops.gemv_bf16(torch.empty(1, 16, dtype=torch.bfloat16), x.float(),
                      torch.ones(16 * 64, dtype=torch.bfloat16))


def test_scales_that_are_not_float16_values_are_refused():
    blocks = q4_blocks("Q4_1", 16, 32)
    with pytest.raises(ValueError, match="float16"):
        native_amx.pack_q4(blocks.q, blocks.scale * (1 + 2 ** -20), blocks.zero)
    head = q8_blocks(16, 32)
    with pytest.raises(ValueError, match="float16"):
        native_gemv.pack_q8(head.q, head.d * (1 + 2 ** -20))
