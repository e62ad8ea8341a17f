"""Mixture-of-experts forward on a GPU: two grouped GEMMs over the (token, slot) pairs sorted by
expert (kernels/triton_moe_align.py), one program per (block of rows, block of columns), each
reading its block's expert id.

  1. gate_up: x @ w13[e]^T, act(gate) * up fused -> act [P, I] (in the model's dtype)
  2. down:    act @ w2[e]^T, times the pair's float32 routing weight -> [P, H] float32
then the k slots of each token summed. Roundings follow the CPU path and HF: gate_up and down
outputs in the model's dtype, the activation's result rounded before the product with up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.moe_weights import ExpertWeights
from kvrelay.kernels.triton_moe_align import align_pairs_by_expert
from kvrelay.kernels.triton_support import ensure_runnable

ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _gated(gate, ACTIVATION: tl.constexpr):  # gate fp32
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate)
    # tanh(y) = 2 * sigmoid(2y) - 1
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))


@triton.jit
def _gate_up_kernel(
    hidden_ptr,  # [T, H]
    w13_ptr,  # [E, 2 * I, H]
    act_ptr,  # [P, I] out
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32
    block_experts_ptr,  # [num_blocks] int32
    num_pairs, top_k, num_experts, hidden_size, inter_size,
    stride_hidden, stride_w13_e, stride_w13_n, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    tokens = pairs // top_k
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    depth = tl.arange(0, BLOCK_K)
    weights = w13_ptr + expert * stride_w13_e
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + depth < hidden_size
        x = tl.load(hidden_ptr + tokens[:, None] * stride_hidden + (k0 + depth)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(weights + cols[None, :] * stride_w13_n + (k0 + depth)[:, None],
                         mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(weights + (inter_size + cols)[None, :] * stride_w13_n + (k0 + depth)[:, None],
                       mask=w_mask, other=0.0)
        if DOT_IN_FP32:
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate += tl.dot(x, w_gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(x, w_up, input_precision=DOT_PRECISION)
    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = _gated(gate, ACTIVATION).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + pairs[:, None] * stride_act + cols[None, :], act.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [P, I]
    w2_ptr,  # [E, H, I]
    weights_ptr,  # [P] float32, the routing weight of each pair
    out_ptr,  # [P, H] float32 out
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32
    block_experts_ptr,  # [num_blocks] int32
    num_pairs, num_experts, hidden_size, inter_size,
    stride_act, stride_w2_e, stride_w2_n, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    depth = tl.arange(0, BLOCK_K)
    weights = w2_ptr + expert * stride_w2_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = k0 + depth < inter_size
        a = tl.load(act_ptr + pairs[:, None] * stride_act + (k0 + depth)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(weights + cols[None, :] * stride_w2_n + (k0 + depth)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    routing = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)  # [BLOCK_M]
    down = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], down,
             mask=row_ok[:, None] & col_ok[None, :])


def fused_moe_triton(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """hidden [T, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 (checked by the
    caller) -> [T, H] in hidden's dtype."""
    ensure_runnable(_gate_up_kernel, hidden.device)
    num_tokens, top_k = topk_ids.shape
    num_pairs, inter = num_tokens * top_k, experts.intermediate_size
    hidden = hidden.contiguous()
    w13, w2 = experts.w13.contiguous(), experts.w2.contiguous()
    block_m, block_n, block_k = _tiles(num_pairs, experts.num_experts)
    sorted_pairs, block_experts = align_pairs_by_expert(topk_ids, experts.num_experts, block_m)
    num_blocks = block_experts.numel()
    # Triton runs CPU tensors only in its interpreter, whose dot multiplies bf16 as raw uint16
    # bits: there the operands go up to fp32 (exact products, as the tensor cores'); on GPUs
    # bf16 goes to the tensor cores as it is.
    dot_in_fp32 = hidden.device.type == "cpu"
    precision = "ieee" if hidden.dtype == torch.float32 or dot_in_fp32 else "tf32"
    act = hidden.new_empty(num_pairs, inter)  # [P, I]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        hidden, w13, act, sorted_pairs, block_experts,
        num_pairs, top_k, experts.num_experts, experts.hidden_size, inter,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        ACTIVATION=ACTIVATION_IDS[activation], DOT_IN_FP32=dot_in_fp32, DOT_PRECISION=precision,
    )
    by_pair = torch.empty(num_pairs, experts.hidden_size, dtype=torch.float32, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(experts.hidden_size, block_n))](
        act, w2, topk_weights.reshape(-1).contiguous(), by_pair, sorted_pairs, block_experts,
        num_pairs, experts.num_experts, experts.hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), by_pair.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_IN_FP32=dot_in_fp32,
        DOT_PRECISION=precision,
    )
    return by_pair.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _tiles(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows (tl.dot's least) while experts get few rows each,
    64 once they average that many."""
    block_m = 64 if num_pairs >= 64 * num_experts else 16
    return block_m, 64, 64
