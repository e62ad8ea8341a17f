"""A GGUF checkpoint's 4-bit matmul weights (Q4_0, Q4_1), in the layout of torch's CPU int4
weight-only matmul, so that small steps multiply the 4-bit weights themselves.

A decode step of a few sequences is bound by reading the weights: the bf16 copy of the default
model's layer matmuls is 213 MB a step, their 4-bit blocks 60 MB. Same numbers: the blocks are
the checkpoint's own, so the weights are the very ones the bf16 copy was dequantized from (the
scales are rounded to bf16 as the bf16 weights are). BENCHMARKS.md has the measurements.

GGUF blocks hold 32 weights of one row: Q4_1 `d` and `m` (float16) then 16 bytes of 4-bit
`q`, the weight being d * q + m; Q4_0 only `d`, the weight d * (q - 8). Element j of a block is
the low nibble of byte j, element j + 16 its high nibble. torch's kernel computes
(q - 8) * scale + zero per group of 32: scale = d, zero = m + 8 d (Q4_1) or 0 (Q4_0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.engine.models.gguf_tensors import read_gguf_tensors

GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
# Our fused matmuls and the GGUF tensors they are made of, in order.
FUSED = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
         "self_attn.o_proj": ("attn_output",),
         "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
         "mlp.down_proj": ("ffn_down",)}


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """torch's int4 CPU layout of one [out_features, in_features] weight."""
    packed: torch.Tensor  # uint8, from _convert_weight_to_int4pack_for_cpu
    scales_zeros: torch.Tensor  # [in_features / 32, out_features, 2] bf16
    input_order: torch.Tensor | None = None  # [in_features] int64: Q4Blocks.input_order

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] bf16 -> [T, out]
        if self.input_order is not None:
            x = x.index_select(1, self.input_order)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP,
                                                          self.scales_zeros)


def int4_supported() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and \
        hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


@dataclass(frozen=True, slots=True)
class Q4Blocks:
    """One tensor's blocks, unpacked: q [N, K] in 0..15, scale and zero [N, K / 32] float32
    such that the weight is (q - 8) * scale + zero. input_order: where the blocks hold the
    inputs in another order (GPTQ act-order groups), column j of q is input input_order[j],
    and a matmul gathers x's columns so; None: in order (every GGUF)."""
    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    input_order: np.ndarray | None = None

    def dequantized(self) -> torch.Tensor:  # [N, K] float32, as the checkpoint's copy
        n, k = self.q.shape
        q = torch.from_numpy(self.q.astype(np.float32)).view(n, k // GROUP, GROUP)
        weight = ((q - 8) * torch.from_numpy(self.scale)[..., None]
                  + torch.from_numpy(self.zero)[..., None]).view(n, k)
        if self.input_order is None:
            return weight
        in_order = torch.empty_like(weight)
        in_order[:, torch.from_numpy(self.input_order)] = weight
        return in_order

    def rows(self, order: np.ndarray) -> "Q4Blocks":
        return Q4Blocks(self.q[order], self.scale[order], self.zero[order], self.input_order)

    def to_torch(self) -> Int4Weight:
        n, _ = self.q.shape
        if n % 16:
            raise ValueError(f"int4 packing needs out_features divisible by 16, got {n}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(self.q.astype(np.int32)), 1)
        scales_zeros = torch.from_numpy(np.stack([self.scale.T, self.zero.T], axis=-1))
        order = None if self.input_order is None else torch.from_numpy(self.input_order)
        return Int4Weight(packed, scales_zeros.to(torch.bfloat16).contiguous(), order)


def unpack_blocks(kind: str, raw: np.ndarray, num_cols: int) -> Q4Blocks:
    """raw: [N, K / 32 * block bytes] uint8, as GGUFReader gives a tensor's data."""
    num_rows = raw.shape[0]
    blocks = raw.reshape(num_rows, num_cols // GROUP, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., -16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(num_rows, num_cols)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    return Q4Blocks(q, d, zero)


def concat(parts: list[Q4Blocks]) -> Q4Blocks | None:
    """The blocks of one fused matmul (rows stacked), or None where the parts take their
    inputs in different orders (then no one gather serves them)."""
    order = parts[0].input_order
    if any(not _same_order(order, part.input_order) for part in parts[1:]):
        return None
    return Q4Blocks(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "scale",
                                                                                "zero")),
                    input_order=order)


def _same_order(first: np.ndarray | None, second: np.ndarray | None) -> bool:
    if first is None or second is None:
        return first is second
    return np.array_equal(first, second)


# The architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel.permute); the
# others (qwen2, qwen3, gemma2, gemma3) keep Hugging Face's row order. Norms of q and k (Qwen3,
# Gemma 3) are vectors, not matmuls: they stay on the loaded weights whatever the file's order.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """The row order that undoes GGUF's rotary permutation of q and k (llama.cpp's converter
    interleaves each head's two rotary halves; transformers un-interleaves them on load)."""
    half = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


def load_from_gguf(gguf_path: str, hf_config,
                   checkpoint: dict[str, torch.Tensor]) -> dict[str, Q4Blocks] | None:
    """Every layer matmul's 4-bit blocks, keyed by our parameter name ("layers.3.mlp.down_proj"),
    or None when the file's matmuls are not all Q4_0/Q4_1. q/k rows are put back in Hugging
    Face's order where the file's architecture has them permuted. Each is checked against the
    checkpoint's dequantized float32 weight (`checkpoint`: our parameter name -> tensor):
    a mismatch (another conversion, another row order) raises ValueError."""
    gguf = read_gguf_tensors(gguf_path)
    tensors, arch = gguf.tensors, gguf.architecture
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads} \
        if arch in PERMUTED_QK_ARCHITECTURES else {}
    weights = {}
    for layer in range(hf_config.num_hidden_layers):
        for ours, pieces in FUSED.items():
            parts = [_blocks(tensors.get(f"blk.{layer}.{piece}.weight"), heads.get(piece))
                     for piece in pieces]
            if any(part is None for part in parts):
                return None
            blocks = concat(parts)
            name = f"layers.{layer}.{ours}"
            if not torch.equal(blocks.dequantized(), checkpoint[f"{name}.weight"].float()):
                raise ValueError(f"{gguf_path}: the 4-bit blocks of {name} do not match the "
                                 f"converted checkpoint")
            weights[name] = blocks
    return weights


def _blocks(tensor, num_heads: int | None) -> Q4Blocks | None:
    if tensor is None or tensor.type_name not in _BLOCK_BYTES:
        return None
    blocks = unpack_blocks(tensor.type_name, np.asarray(tensor.data),
                           int(tensor.shape[0]))
    if num_heads is None:
        return blocks
    return blocks.rows(unpermute_rows(blocks.q.shape[0], num_heads))
