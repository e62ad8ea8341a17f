"""A GGUF checkpoint's 4-bit matmul weights (Q4_0, Q4_1, Q4_K), in the layout of torch's CPU int4
weight-only matmul, so that small steps multiply the 4-bit weights themselves.

A decode step of a few sequences is bound by reading the weights: the bf16 copy of the default
model's layer matmuls is 213 MB a step, their 4-bit blocks 60 MB. Same numbers: the blocks are
the checkpoint's own, so the weights are the very ones the bf16 copy was dequantized from (the
scales are rounded to bf16 as the bf16 weights are). BENCHMARKS.md has the measurements.

GGUF blocks hold 32 weights of one row: Q4_1 `d` and `m` (float16) then 16 bytes of 4-bit
`q`, the weight being d * q + m; Q4_0 only `d`, the weight d * (q - 8). Element j of a block is
the low nibble of byte j, element j + 16 its high nibble. torch's kernel computes
(q - 8) * scale + zero per group of 32: scale = d, zero = m + 8 d (Q4_1) or 0 (Q4_0). Q4_K's
256-weight blocks unpack to the same form, a scale and zero per 32 (`_unpack_q4_k`).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvrelay.engine.models.gguf_tensors import read_gguf_tensors

log = logging.getLogger(__name__)

GROUP = 32
# bytes a block takes, and the weights of a row it holds
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}
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
    """raw: [N, K / block weights * block bytes] uint8, as GGUFReader gives a tensor's data."""
    num_rows = raw.shape[0]
    if kind == "Q4_K":
        return _unpack_q4_k(raw.reshape(num_rows, num_cols // 256, _BLOCK_BYTES[kind]), num_cols)
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


def _unpack_q4_k(blocks: np.ndarray, num_cols: int) -> Q4Blocks:
    """blocks [N, K / 256, 144]: ggml's block_q4_K, 256 weights in 8 sub-blocks of 32. Bytes
    0-3: d and dmin (float16); 4-15: each sub-block's 6-bit scale sc and min m (bytes 0-3 of
    them hold sc[0..3] and, in their top bits, sc[4..7]'s top bits; 4-7 the same for m; 8-11
    the low nibbles of sc[4..7] and, above them, of m[4..7]); 16-143: the codes, byte 32c + l
    holding weight l of sub-block 2c (low nibble) and of 2c + 1 (high). Weight: d * sc * q -
    dmin * m, i.e. (q - 8) * scale + zero with scale = d * sc, zero = 8 * scale - dmin * m."""
    num_rows, num_supers, _ = blocks.shape
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:16]
    low, mins, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=-1)  # [N, S, 8]
    m = np.concatenate([mins & 63, (high >> 4) | ((mins >> 6) << 4)], axis=-1)
    codes = blocks[..., 16:].reshape(num_rows, num_supers, 4, 1, GROUP)
    q = (codes >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F  # [N, S, 4, 2, 32]
    scale = (d[..., None] * sc).reshape(num_rows, -1)  # [N, K / 32], exact in float32
    zero = 8 * scale - (dmin[..., None] * m).reshape(num_rows, -1)
    return Q4Blocks(q.reshape(num_rows, num_cols), scale, zero)


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


def load_from_gguf(gguf_path: str, hf_config, checkpoint: dict[str, torch.Tensor],
                   layers: range | None = None) -> dict[str, Q4Blocks] | None:
    """The 4-bit blocks of each layer matmul whose parts are all Q4_0, Q4_1 or Q4_K, keyed by our
    parameter name ("layers.3.mlp.down_proj"), or None where no matmul's are (the others run
    on the dequantized weights; a Q4_K_M file mixes Q4_K with Q6_K, say). q/k rows are put
    back in Hugging Face's order where the file's architecture has them permuted. Each is
    checked against the checkpoint's dequantized float32 weight (`checkpoint`: our parameter
    name -> tensor): a mismatch (another conversion, another row order) raises ValueError.
    layers: those whose matmuls this process runs (a pipeline stage's), default every one."""
    layers = range(hf_config.num_hidden_layers) if layers is None else layers
    gguf = read_gguf_tensors(gguf_path)
    tensors, arch = gguf.tensors, gguf.architecture
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads} \
        if arch in PERMUTED_QK_ARCHITECTURES else {}
    weights, others = {}, Counter()
    for layer in layers:
        for ours, pieces in FUSED.items():
            found = [tensors.get(f"blk.{layer}.{piece}.weight") for piece in pieces]
            if any(tensor is None or tensor.type_name not in _BLOCK_BYTES for tensor in found):
                others.update(t.type_name for t in found if t is not None)
                continue
            name = f"layers.{layer}.{ours}"
            weights[name] = _checked(gguf_path, name, checkpoint[f"{name}.weight"],
                                     [_blocks(t, heads.get(p)) for t, p in zip(found, pieces)],
                                     exact=all(t.type_name != "Q4_K" for t in found))
    if others:
        log.info("%s: %d of %d layer matmuls run small steps on their 4-bit blocks; the rest "
                 "(parts in %s) on the dequantized weights", Path(gguf_path).name, len(weights),
                 len(layers) * len(FUSED), ", ".join(sorted(others)))
    return weights or None


def _checked(gguf_path: str, name: str, weight: torch.Tensor, parts: list[Q4Blocks],
             exact: bool) -> Q4Blocks:
    """The fused blocks, if they dequantize to the converted weight: bit for bit for Q4_0/Q4_1
    (one rounding either way); within an ulp for Q4_K, whose offset (8 * scale - dmin * m) is
    rounded once before the sum where gguf rounds q * scale - dmin * m once."""
    blocks = concat(parts)
    got, want = blocks.dequantized(), weight.float()
    matches = torch.equal(got, want) if exact else \
        torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    if not matches:
        raise ValueError(f"{gguf_path}: the 4-bit blocks of {name} do not match the converted "
                         f"checkpoint")
    return blocks


def _blocks(tensor, num_heads: int | None) -> Q4Blocks:
    blocks = unpack_blocks(tensor.type_name, np.asarray(tensor.data),
                           int(tensor.shape[0]))
    if num_heads is None:
        return blocks
    return blocks.rows(unpermute_rows(blocks.q.shape[0], num_heads))
