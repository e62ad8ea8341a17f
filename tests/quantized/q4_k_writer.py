"""A reference Q4_K quantizer, packed as ggml lays out `block_q4_K` (gguf-py reads these bytes;
it has no Q4_K quantizer of its own):

    struct block_q4_K {            // 256 weights of a row, 144 bytes
        half d, dmin;              // super-block scales of the sub-block scales and mins
        uint8 scales[12];          // 8 sub-blocks' 6-bit scale and 6-bit min, packed
        uint8 qs[128];             // 4-bit codes: byte 32c + l holds sub-block 2c's weight l in
    };                             // its low nibble and sub-block 2c + 1's in its high nibble

Weight l of sub-block j is d * sc[j] * q - dmin * m[j]. scales[12]: bytes 0-3 hold sc[0..3]
(low 6 bits) and sc[4..7]'s top two bits; bytes 4-7 m[0..3] and m[4..7]'s top two bits;
bytes 8-11 sc[4..7]'s low four bits, then m[4..7]'s low four bits above them.
Round to nearest per 32-weight sub-block (llama.cpp searches for better scales; the layout is
what matters here).
"""
from __future__ import annotations

import numpy as np

SUPER = 256
SUB = 32
BLOCK_BYTES = 144


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K a multiple of 256) -> [N, K / 256 * 144] uint8."""
    rows, cols = weights.shape
    blocks = weights.astype(np.float32).reshape(-1, SUPER // SUB, SUB)  # [B, 8, 32]
    low = np.minimum(blocks.min(-1), 0)
    high = np.maximum(blocks.max(-1), 0)
    sub_scales, sub_mins = (high - low) / 15, -low  # [B, 8]
    d = (sub_scales.max(-1) / 63).astype(np.float16)
    dmin = (sub_mins.max(-1) / 63).astype(np.float16)
    sc = _codes(sub_scales, d)
    m = _codes(sub_mins, dmin)
    step = d.astype(np.float32)[:, None] * sc  # [B, 8]
    offset = dmin.astype(np.float32)[:, None] * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0,
                     np.round((blocks + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [B, 8, 32]
    packed = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _pack_scales(sc, m), _pack_codes(q)], axis=-1)
    assert packed.shape[-1] == BLOCK_BYTES
    return packed.reshape(rows, cols // SUPER * BLOCK_BYTES)


def _codes(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    unit = unit.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(unit > 0, np.round(values / unit), 0)
    return np.clip(codes, 0, 63).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[B, 8] 6-bit scales and mins -> [B, 12] bytes."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _pack_codes(q: np.ndarray) -> np.ndarray:
    """[B, 8, 32] codes -> [B, 128] bytes: sub-blocks 2c (low nibble) and 2c + 1 (high)."""
    pairs = q.reshape(q.shape[0], 4, 2, SUB)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def reference_dequantize(packed: np.ndarray, cols: int) -> np.ndarray:
    """The formula of the module docstring, from the bytes: [N, K] float32."""
    rows = packed.shape[0]
    blocks = packed.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    raw = blocks[:, 4:16]
    sc = np.concatenate([raw[:, 0:4] & 63, (raw[:, 8:12] & 0xF) | ((raw[:, 0:4] >> 6) << 4)], 1)
    m = np.concatenate([raw[:, 4:8] & 63, (raw[:, 8:12] >> 4) | ((raw[:, 4:8] >> 6) << 4)], 1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, SUB) >> np.array([0, 4], dtype=np.uint8)[:, None]
    q = (qs & 0xF).reshape(-1, 8, SUB).astype(np.float32)
    weights = (d[:, None] * sc)[..., None] * q - (dmin[:, None] * m)[..., None]
    return weights.reshape(rows, cols)
