"""GPTQ and AWQ 4-bit tensors unpacked into one form: 4-bit codes per weight, a float16 scale and
an integer zero point per group and output column, and each input column's group.

Layouts (per linear of out_features N, in_features K, G groups):
- GPTQ: `qweight` int32 [K/8, N], eight consecutive input rows per word, row k in bits
  4*(k % 8); `qzeros` int32 [G, N/8], column n in bits 4*(n % 8); `scales` float16 [G, N];
  `g_idx` int32 [K], input column k's group (k // group_size unless act-order reordered them).
  The weight is scale * (q - (zero + zero_offset)): checkpoint_format "gptq" stores zero - 1.
- AWQ (GEMM): `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], eight output columns per
  word in the interleaved order AWQ_ORDER (nibble i holds column 8c + AWQ_ORDER[i]); `scales`
  float16 [G, N]; input column k is in group k // group_size. The weight is scale * (q - zero).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.engine.models.gguf_int4 import GROUP, Q4Blocks
from kvrelay.engine.models.quant_schemes import Int4Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # g_idx optional
AWQ_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True)
class Int4Tensor:
    """One linear's weight: w[n, k] = scales[g, n] * (q[n, k] - zeros[g, n]), g = groups[k]."""
    q: np.ndarray  # [N, K] uint8 in 0..15
    scales: np.ndarray  # [G, N] float32 holding float16 values
    zeros: np.ndarray  # [G, N] int32 in 0..16
    groups: np.ndarray  # [K] int64 in 0..G-1

    def dequantized(self) -> torch.Tensor:  # [N, K] float32; exact (a 4-bit int times a half)
        scales = self.scales[self.groups].T  # [N, K]
        zeros = self.zeros[self.groups].T.astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(scales * (self.q.astype(np.float32) - zeros)))

    def to_q4_blocks(self) -> Q4Blocks | None:
        """The same weight in blocks of 32 inputs (gguf_int4.Q4Blocks: (q - 8) * scale + zero,
        zero = (8 - zero point) * scale, exact in float32), the inputs reordered by group where
        act-order interleaved them; None where no order makes every block one group's."""
        num_inputs = self.q.shape[1]
        if num_inputs % GROUP:
            return None
        order, groups = None, self.groups
        if not _blocks_hold_one_group(groups):
            order = np.argsort(groups, kind="stable")
            groups = groups[order]
            if not _blocks_hold_one_group(groups):
                return None
        block_groups = groups[::GROUP]  # [K / 32]
        scale = np.ascontiguousarray(self.scales[block_groups].T)  # [N, K / 32]
        zero = (8 - self.zeros[block_groups].T).astype(np.float32) * scale
        q = self.q if order is None else np.ascontiguousarray(self.q[:, order])
        return Q4Blocks(q, scale, zero, input_order=order)


def _blocks_hold_one_group(groups: np.ndarray) -> bool:
    blocks = groups.reshape(-1, GROUP)
    return bool((blocks == blocks[:, :1]).all())


def unpack(scheme: Int4Scheme, name: str, parts: dict[str, torch.Tensor]) -> Int4Tensor:
    """parts: the module's tensors by suffix (qweight, qzeros, scales[, g_idx]). ValueError
    naming the module where a part is missing, mis-shaped or out of range."""
    wanted = AWQ_PARTS if scheme.method == "awq" else GPTQ_PARTS[:3]
    missing = [part for part in wanted if part not in parts]
    if missing:
        raise ValueError(f"{scheme.method.upper()} module {name} lacks {', '.join(missing)}")
    for part in ("qweight", "qzeros"):
        if parts[part].dtype != torch.int32 or parts[part].dim() != 2:
            raise ValueError(f"{name}.{part}: expected a 2-D int32 tensor, got "
                             f"{parts[part].dtype} {tuple(parts[part].shape)}")
    if parts["scales"].dim() != 2 or not parts["scales"].is_floating_point():
        raise ValueError(f"{name}.scales: expected a 2-D float tensor, got "
                         f"{parts['scales'].dtype} {tuple(parts['scales'].shape)}")
    if scheme.method == "awq":
        return _awq(scheme, name, parts)
    return _gptq(scheme, name, parts)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., W] -> uint8 [..., W, 8], nibble i of each word (bits 4i..4i+3)."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((words.view(np.uint32)[..., None] >> shifts) & 0xF).astype(np.uint8)


def _scales(name: str, scales: torch.Tensor, shape: tuple[int, int]) -> np.ndarray:
    if tuple(scales.shape) != shape:
        raise ValueError(f"{name}.scales: shape {tuple(scales.shape)}, expected {shape}")
    values = scales.to(torch.float16).float().numpy()
    if not np.isfinite(values).all():
        raise ValueError(f"{name}.scales: not every scale is finite")
    return values


def _group_count(scheme: Int4Scheme, name: str, num_inputs: int) -> int:
    if scheme.group_size == -1:
        return 1
    if num_inputs % scheme.group_size:
        raise ValueError(f"{name}: {num_inputs} inputs are not whole groups of "
                         f"{scheme.group_size}")
    return num_inputs // scheme.group_size


def _gptq(scheme: Int4Scheme, name: str, parts: dict[str, torch.Tensor]) -> Int4Tensor:
    qweight = parts["qweight"].numpy()
    num_inputs, num_outputs = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = _group_count(scheme, name, num_inputs)
    if tuple(parts["qzeros"].shape) != (num_groups, num_outputs // 8) or num_outputs % 8:
        raise ValueError(f"{name}.qzeros: shape {tuple(parts['qzeros'].shape)}, expected "
                         f"{(num_groups, num_outputs // 8)}")
    q = _nibbles(qweight).transpose(0, 2, 1).reshape(num_inputs, num_outputs).T  # [N, K]
    zeros = _nibbles(parts["qzeros"].numpy()).reshape(num_groups, num_outputs)
    scales = _scales(name, parts["scales"], (num_groups, num_outputs))
    groups = _gptq_groups(scheme, name, parts.get("g_idx"), num_inputs, num_groups)
    return Int4Tensor(np.ascontiguousarray(q), scales,
                      zeros.astype(np.int32) + scheme.zero_offset, groups)


def _gptq_groups(scheme: Int4Scheme, name: str, g_idx: torch.Tensor | None, num_inputs: int,
                 num_groups: int) -> np.ndarray:
    in_order = np.arange(num_inputs, dtype=np.int64) * num_groups // num_inputs
    if g_idx is None:
        if scheme.act_order:
            raise ValueError(f"GPTQ module {name} lacks g_idx, which act-order (desc_act) needs")
        return in_order
    groups = g_idx.to(torch.int64).numpy()
    if groups.shape != (num_inputs,) or groups.min() < 0 or groups.max() >= num_groups:
        raise ValueError(f"{name}.g_idx: expected {num_inputs} groups in 0..{num_groups - 1}")
    return groups


def _awq(scheme: Int4Scheme, name: str, parts: dict[str, torch.Tensor]) -> Int4Tensor:
    qweight = parts["qweight"].numpy()
    num_inputs, num_outputs = qweight.shape[0], qweight.shape[1] * 8
    num_groups = _group_count(scheme, name, num_inputs)
    if tuple(parts["qzeros"].shape) != (num_groups, num_outputs // 8):
        raise ValueError(f"{name}.qzeros: shape {tuple(parts['qzeros'].shape)}, expected "
                         f"{(num_groups, num_outputs // 8)}")
    q = _awq_columns(qweight).T  # [N, K]
    zeros = _awq_columns(parts["qzeros"].numpy())
    scales = _scales(name, parts["scales"], (num_groups, num_outputs))
    groups = np.arange(num_inputs, dtype=np.int64) * num_groups // num_inputs
    return Int4Tensor(np.ascontiguousarray(q), scales, zeros.astype(np.int32), groups)


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """int32 [R, N/8] -> uint8 [R, N] with the interleave undone."""
    nibbles = _nibbles(words)  # [R, N/8, 8]: nibble i is column 8c + AWQ_ORDER[i]
    columns = np.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles
    return columns.reshape(words.shape[0], -1)
