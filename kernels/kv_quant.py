"""8-bit KV cache rows: the formats, and the torch reference that writes and reads them.

A cache row (one token's one kv head) of an 8-bit cache is head_dim codes followed by the row's
float32 scale, head_dim + 4 bytes. The row coded is the token's K (or V) rotated by a normalized
Hadamard matrix H (`rotate`): code[d] = (H x)[d] / scale rounded, with
scale = max |H x| / (the code's largest value) computed as the row is written. The rotation
spreads a row's outlier dimensions (this model family's keys run at 5x their RMS in a few) over
all of them, so the scale, set by the largest, is finer for the rest: measured on the default
model in float32, int8 rows then change 0 of 192 teacher-forced greedy tokens against the float
cache (3 without it) and halve the mean logprob error. H is symmetric and orthonormal, so
q . k = (H q) . (H k) and sum p v = H (sum p (H v)): the attention kernels read the rotated rows
as they are, given H q, and rotate their output back; the torch paths and the reference
dequantize (and rotate back) instead.

The scale sits in the row, not in a tensor of its own, so that a block's bytes are everything a
KV transfer (PD's gRPC and shared-memory pushes) or the prefix cache moves, unchanged. The cache
tensor's dtype names the code (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2); its last
dimension is the row's width in bytes.

A scale per row rather than one per tensor (what vLLM's fp8 cache defaults to, with scale 1)
keeps fp8's relative precision whatever a layer's K and V magnitudes are and needs no
calibration; int8 by row absmax is within 1/254 of each row's largest value.

The native CPU store (kernels/csrc/paged_decode_binding.cpp) computes the same codes bit for bit;
the attention kernels read the codes in place (kernels/csrc/kv_codes.h).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels.kv_code_names import canonical

SCALE_BYTES = 4


@dataclass(frozen=True)
class KvCodeFormat:
    name: str  # --kv-cache-dtype's value
    dtype: torch.dtype  # the cache tensor's dtype, which names the code
    max_code: float  # the largest magnitude a code holds


FORMATS = {fmt.name: fmt for fmt in (
    KvCodeFormat("int8", torch.int8, 127.0),
    KvCodeFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    KvCodeFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
)}
_BY_DTYPE = {fmt.dtype: fmt for fmt in FORMATS.values()}


def parse(name: str) -> KvCodeFormat | None:
    """--kv-cache-dtype's value as a format; None for "auto" (the model's dtype)."""
    name = canonical(name)
    return None if name == "auto" else FORMATS[name]


def format_of(cache: torch.Tensor) -> KvCodeFormat | None:
    """The 8-bit format a cache tensor holds, or None for a float cache."""
    return _BY_DTYPE.get(cache.dtype)


def row_width(head_dim: int, fmt: KvCodeFormat | None) -> int:
    """Elements of a cache row: head_dim, and the scale's bytes after 8-bit codes."""
    if fmt is not None and head_dim % SCALE_BYTES:
        # the scale is read as a float32 at a multiple of 4 bytes
        raise ValueError(f"an 8-bit KV cache needs head_dim a multiple of 4, not {head_dim}")
    return head_dim if fmt is None else head_dim + SCALE_BYTES


def rotation_block(head_dim: int) -> int:
    """The Hadamard block: the largest power of two that divides head_dim (64 for 64, 16 for 80);
    the rotation is block diagonal where head_dim is not a power of two."""
    return head_dim & -head_dim


def rotate(
    x: torch.Tensor,  # [..., head_dim]
) -> torch.Tensor:  # [..., head_dim] float32: H x, and rotate(rotate(x)) == x up to rounding
    """The normalized Hadamard transform of each row, by butterflies: elementwise adds, so a row's
    result does not depend on the rows beside it (a matmul's may, with its blocking), and the
    native store codes exactly what the torch reference codes."""
    head_dim = x.shape[-1]
    block = rotation_block(head_dim)
    y = x.float().reshape(-1, head_dim // block, block)
    half = 1
    while half < block:
        pairs = y.view(y.shape[0], y.shape[1], block // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((low + high, low - high), dim=-2).view(y.shape)
        half *= 2
    return (y * block ** -0.5).view(x.shape)


def quantize_rows(
    values: torch.Tensor,  # [..., head_dim] float32 or bfloat16
    fmt: KvCodeFormat,
) -> torch.Tensor:  # [..., head_dim + 4] fmt.dtype: the codes, then the scale's bytes
    return code_rotated_rows(rotate(values), fmt)


def code_rotated_rows(
    x: torch.Tensor,  # [..., head_dim] float32, already rotated
    fmt: KvCodeFormat,
) -> torch.Tensor:  # [..., head_dim + 4] fmt.dtype
    scale = x.abs().amax(dim=-1, keepdim=True) / fmt.max_code  # [..., 1]
    scaled = torch.where(scale > 0, x / scale, 0.0).clamp(-fmt.max_code, fmt.max_code)
    if fmt.dtype == torch.int8:
        codes = scaled.round().to(torch.int8)  # round half to even, as the native store
    else:
        codes = scaled.to(fmt.dtype)
    return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1).view(fmt.dtype)


def dequantize_rows(
    rows: torch.Tensor,  # [..., head_dim + 4] in a format's dtype
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., head_dim]
    fmt = format_of(rows)
    if fmt is None:
        raise ValueError(f"{rows.dtype} is not an 8-bit KV code")
    raw = rows.view(torch.uint8)
    head_dim = raw.shape[-1] - SCALE_BYTES
    codes = raw[..., :head_dim].view(fmt.dtype).float()
    scale = raw[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return rotate(codes * scale).to(dtype)


def as_float_rows(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as values: 8-bit rows dequantized into `dtype`, float rows as they are."""
    return cache_rows if format_of(cache_rows) is None else dequantize_rows(cache_rows, dtype)


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 where it holds 8-bit codes (torch has no index_copy_ for float8), else
    the cache itself."""
    return cache.view(torch.uint8) if format_of(cache) is not None else cache
