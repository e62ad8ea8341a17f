"""Batched LoRA on a GPU (Triton): each token of a flat batch applies its own adapter slot's A
and B (-1: none), with no host sync and no sort of the tokens by slot.

  shrink: out [T, R] float32 = x [T, in] @ a[slot]^T     grid (token blocks, rank blocks, lanes)
  expand: y [T, out] = round(y + xa [T, R] @ b_t[slot])  grid (token blocks, column blocks, lanes)

A block of BLOCK_T consecutive tokens whose slots are all one (a prefill's tokens come in long
runs of one sequence, hence one adapter) is one tile matmul with tl.dot, as Punica's SGMV: its
lane-0 program does it, reading the slot's weights once for the block. A block of mixed slots
(a decode step's tokens) is done per token, as Punica's BGMV: lane i's program takes token i
of the block, so mixed blocks keep a program per token. Programs with nothing to do return
after reading BLOCK_T slots. Small batches (T < 16, where a 16-row tile would be mostly
padding) use BLOCK_T = 1: per-token programs only.

Sums run in float32; 16-bit y is rounded once, to nearest even. Slots outside -1..S-1 count as
-1 here (checking them would cost a sync); the CPU kernels raise on them.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests); the interpreter's dot
multiplies bf16 as raw bits, so there the operands go to float32 first (as in triton_moe.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton_support import ensure_runnable


@triton.jit
def _token_slot(slots_ptr, token, num_slots):
    """The token's slot as int64; -1 where none or out of range."""
    slot = tl.load(slots_ptr + token)
    return tl.where((slot >= 0) & (slot < num_slots), slot, -1).to(tl.int64)


@triton.jit
def _uniform_slot(slots_ptr, first, num_tokens, num_slots, BLOCK_T: tl.constexpr):
    """(is every token of the block in one slot, that slot): the tile path's condition."""
    tokens = first + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=-1)
    slots = tl.where((slots >= 0) & (slots < num_slots), slots, -1)
    lowest = tl.min(tl.where(token_ok, slots, num_slots), axis=0)
    highest = tl.max(tl.where(token_ok, slots, -1), axis=0)
    return lowest == highest, lowest.to(tl.int64)


# ---- shrink ---------------------------------------------------------------------------------


@triton.jit
def _shrink_token(x_ptr, a_ptr, out_ptr, token, slot, rank0, num_ranks, in_features,
                  stride_x, stride_a_slot, stride_a_rank, stride_out,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[token, ranks] = a[slot, ranks] @ x[token]: BLOCK_R dot products (zeros: no slot)."""
    ranks = rank0 + tl.arange(0, BLOCK_R)
    rank_ok = ranks < num_ranks
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        x_row = x_ptr + token * stride_x
        weights = a_ptr + slot * stride_a_slot
        for k0 in range(0, in_features, BLOCK_K):
            depth = k0 + tl.arange(0, BLOCK_K)
            k_ok = depth < in_features
            x = tl.load(x_row + depth, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
            a = tl.load(weights + ranks[:, None] * stride_a_rank + depth[None, :],
                        mask=rank_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_out + ranks, acc, mask=rank_ok)


@triton.jit
def _shrink_tile(x_ptr, a_ptr, out_ptr, first, slot, num_tokens, rank0, num_ranks, in_features,
                 stride_x, stride_a_slot, stride_a_rank, stride_out,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[tokens, ranks] = x[tokens] @ a[slot, ranks]^T for a block of one slot (zeros: none)."""
    tokens = (first + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = tokens < num_tokens
    ranks = rank0 + tl.arange(0, BLOCK_R)
    rank_ok = ranks < num_ranks
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        weights = a_ptr + slot * stride_a_slot
        for k0 in range(0, in_features, BLOCK_K):
            depth = k0 + tl.arange(0, BLOCK_K)
            k_ok = depth < in_features
            x = tl.load(x_ptr + tokens[:, None] * stride_x + depth[None, :],
                        mask=token_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            a_t = tl.load(weights + ranks[None, :] * stride_a_rank + depth[:, None],
                          mask=k_ok[:, None] & rank_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
            if DOT_IN_FP32:
                x, a_t = x.to(tl.float32), a_t.to(tl.float32)
            acc += tl.dot(x, a_t, input_precision=DOT_PRECISION)
    tl.store(out_ptr + tokens[:, None] * stride_out + ranks[None, :], acc,
             mask=token_ok[:, None] & rank_ok[None, :])


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, in], rows stride_x apart
    a_ptr,  # [S, R, in]
    out_ptr,  # [T, R] float32 out
    slots_ptr,  # [T] int32
    num_tokens, num_slots, num_ranks, in_features,
    stride_x, stride_a_slot, stride_a_rank, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block, rank0, lane = tl.program_id(0), tl.program_id(1) * BLOCK_R, tl.program_id(2)
    first = block.to(tl.int64) * BLOCK_T
    if BLOCK_T == 1:
        _shrink_token(x_ptr, a_ptr, out_ptr, first, _token_slot(slots_ptr, first, num_slots),
                      rank0, num_ranks, in_features, stride_x, stride_a_slot, stride_a_rank,
                      stride_out, BLOCK_R, BLOCK_K)
    else:
        uniform, slot = _uniform_slot(slots_ptr, first, num_tokens, num_slots, BLOCK_T)
        if uniform:
            if lane == 0:
                _shrink_tile(x_ptr, a_ptr, out_ptr, first, slot, num_tokens, rank0, num_ranks,
                             in_features, stride_x, stride_a_slot, stride_a_rank, stride_out,
                             BLOCK_T, BLOCK_R, BLOCK_K, DOT_IN_FP32, DOT_PRECISION)
        else:
            token = first + lane
            if token < num_tokens:
                _shrink_token(x_ptr, a_ptr, out_ptr, token,
                              _token_slot(slots_ptr, token, num_slots), rank0, num_ranks,
                              in_features, stride_x, stride_a_slot, stride_a_rank, stride_out,
                              BLOCK_R, BLOCK_K)


# ---- expand ---------------------------------------------------------------------------------


@triton.jit
def _expand_token(y_ptr, xa_ptr, b_ptr, token, slot, col0, num_ranks, out_features,
                  stride_y, stride_xa, stride_b_slot, stride_b_rank,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[token, cols] += xa[token] @ b_t[slot, :, cols], rounded once (untouched: no slot)."""
    if slot >= 0:
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < out_features
        weights = b_ptr + slot * stride_b_slot
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, num_ranks, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < num_ranks
            xa = tl.load(xa_ptr + token * stride_xa + ranks, mask=rank_ok, other=0.0)  # [BLOCK_R]
            b = tl.load(weights + ranks[:, None] * stride_b_rank + cols[None, :],
                        mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            acc += tl.sum(xa[:, None] * b.to(tl.float32), axis=0)
        y_row = y_ptr + token * stride_y + cols
        y = tl.load(y_row, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _expand_tile(y_ptr, xa_ptr, b_ptr, first, slot, num_tokens, col0, num_ranks, out_features,
                 stride_y, stride_xa, stride_b_slot, stride_b_rank,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[tokens, cols] += xa[tokens] @ b_t[slot, :, cols] for a block of one slot, in float32
    (xa is float32, so the dot is IEEE float32 everywhere)."""
    if slot >= 0:
        tokens = (first + tl.arange(0, BLOCK_T)).to(tl.int64)
        token_ok = tokens < num_tokens
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < out_features
        weights = b_ptr + slot * stride_b_slot
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, num_ranks, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < num_ranks
            xa = tl.load(xa_ptr + tokens[:, None] * stride_xa + ranks[None, :],
                         mask=token_ok[:, None] & rank_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_R]
            b = tl.load(weights + ranks[:, None] * stride_b_rank + cols[None, :],
                        mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            acc += tl.dot(xa, b.to(tl.float32), input_precision="ieee")
        y_tile = y_ptr + tokens[:, None] * stride_y + cols[None, :]
        tile_ok = token_ok[:, None] & col_ok[None, :]
        y = tl.load(y_tile, mask=tile_ok, other=0.0).to(tl.float32)
        tl.store(y_tile, (y + acc).to(y_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, out], rows stride_y apart (a column slice of a wider output)
    xa_ptr,  # [T, R] float32, rows stride_xa apart
    b_ptr,  # [S, R, out]
    slots_ptr,  # [T] int32
    num_tokens, num_slots, num_ranks, out_features,
    stride_y, stride_xa, stride_b_slot, stride_b_rank,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    block, col0, lane = tl.program_id(0), tl.program_id(1) * BLOCK_N, tl.program_id(2)
    first = block.to(tl.int64) * BLOCK_T
    if BLOCK_T == 1:
        _expand_token(y_ptr, xa_ptr, b_ptr, first, _token_slot(slots_ptr, first, num_slots), col0,
                      num_ranks, out_features, stride_y, stride_xa, stride_b_slot, stride_b_rank,
                      BLOCK_R, BLOCK_N)
    else:
        uniform, slot = _uniform_slot(slots_ptr, first, num_tokens, num_slots, BLOCK_T)
        if uniform:
            if lane == 0:
                _expand_tile(y_ptr, xa_ptr, b_ptr, first, slot, num_tokens, col0, num_ranks,
                             out_features, stride_y, stride_xa, stride_b_slot, stride_b_rank,
                             BLOCK_T, BLOCK_R, BLOCK_N)
        else:
            token = first + lane
            if token < num_tokens:
                _expand_token(y_ptr, xa_ptr, b_ptr, token, _token_slot(slots_ptr, token, num_slots),
                              col0, num_ranks, out_features, stride_y, stride_xa, stride_b_slot,
                              stride_b_rank, BLOCK_R, BLOCK_N)


# ---- launchers --------------------------------------------------------------------------------


def shrink(x: torch.Tensor,  # [T, in], unit column stride
           a: torch.Tensor,  # [S, R, in], x's dtype, unit last stride
           token_slots: torch.Tensor,  # [T] int32
           block_tokens: int | None = None,  # tokens per block; None: by T (tests force it)
           ) -> torch.Tensor:  # [T, R] float32
    ensure_runnable(_shrink_kernel, x.device)
    num_tokens, (num_slots, num_ranks, in_features) = x.shape[0], a.shape
    out = torch.empty((num_tokens, num_ranks), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_ranks == 0:
        return out
    block_t = _block_tokens(num_tokens) if block_tokens is None else block_tokens
    block_r = _block_ranks(num_ranks)
    # the interpreter's dot takes bf16 as raw bits: float32 there; on a GPU 16-bit operands go
    # to the tensor cores as they are (exact products, float32 sums), float32 ones as IEEE
    dot_in_fp32 = x.device.type == "cpu"
    precision = "ieee" if x.dtype == torch.float32 or dot_in_fp32 else "tf32"
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_ranks, block_r), block_t)
    _shrink_kernel[grid](
        x, a, out, token_slots, num_tokens, num_slots, num_ranks, in_features,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=128 if block_r <= 32 else 64,
        DOT_IN_FP32=dot_in_fp32, DOT_PRECISION=precision,
    )
    return out


def expand_(y: torch.Tensor,  # [T, out], unit column stride (rows may be strided)
            xa: torch.Tensor,  # [T, R] float32, unit column stride
            b_t: torch.Tensor,  # [S, R, out], y's dtype, unit last stride
            token_slots: torch.Tensor,  # [T] int32
            block_tokens: int | None = None,  # tokens per block; None: by T (tests force it)
            ) -> None:
    ensure_runnable(_expand_kernel, y.device)
    num_tokens, (num_slots, num_ranks, out_features) = y.shape[0], b_t.shape
    if num_tokens == 0 or out_features == 0:
        return
    block_t = _block_tokens(num_tokens) if block_tokens is None else block_tokens
    block_n = 128 if block_t == 1 else 64  # a per-token program's columns; a tile's
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(out_features, block_n), block_t)
    _expand_kernel[grid](
        y, xa, b_t, token_slots, num_tokens, num_slots, num_ranks, out_features,
        y.stride(0), xa.stride(0), b_t.stride(0), b_t.stride(1),
        BLOCK_T=block_t, BLOCK_R=_block_ranks(num_ranks), BLOCK_N=block_n,
    )


def _block_tokens(num_tokens: int) -> int:
    """1 (per-token programs only) for a few tokens, where a 16-row tile would be mostly
    padding; 16 (tl.dot's least) for a decode batch; 32 for a prefill's long runs."""
    if num_tokens < 16:
        return 1
    return 16 if num_tokens < 256 else 32


def _block_ranks(num_ranks: int) -> int:
    """R rounded up to a power of two in 16 (tl.dot's least) .. 64 (larger R loops)."""
    return min(64, max(16, triton.next_power_of_2(num_ranks)))
