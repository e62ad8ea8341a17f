"""A GGUF checkpoint's 8-bit head (Q8_0 blocks: a float16 d and 32 int8 q, the weight d * q),
for the small steps' 8-bit kernel (kernels/csrc/cpu_gemv_q8.cpp).

The head is a decode step's largest matmul: the default model's tied embedding is 28 M weights,
57 MB in bf16 but 30 MB in its checkpoint's Q8_0 form, and a step of one token is bound by
reading it. The blocks are the checkpoint's own weights, exactly (the bf16 copy rounds each
d * q to 8 significant bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.engine.models.gguf_int4 import GROUP
from kvrelay.engine.models.gguf_tensors import read_gguf_tensors

_Q8_BLOCK_BYTES = 2 + GROUP
HEAD_TENSORS = ("output.weight", "token_embd.weight")  # an untied head, else the tied one


@dataclass(frozen=True, slots=True)
class Q8Blocks:
    """q [N, K] int8 and d [N, K / 32] float32 (float16 values): the weight is d * q."""
    q: np.ndarray
    d: np.ndarray

    def dequantized(self) -> torch.Tensor:  # [N, K] float32, as the checkpoint's copy
        n, k = self.q.shape
        q = torch.from_numpy(self.q.astype(np.float32)).view(n, k // GROUP, GROUP)
        return (q * torch.from_numpy(self.d)[..., None]).view(n, k)


def unpack_q8_0(raw: np.ndarray, num_cols: int) -> Q8Blocks:
    """raw [N, K / 32 * 34] uint8, as GGUFReader gives a Q8_0 tensor's data."""
    num_rows = raw.shape[0]
    blocks = raw.reshape(num_rows, num_cols // GROUP, _Q8_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(num_rows, num_cols)
    return Q8Blocks(q, d)


def load_head_from_gguf(gguf_path: str, head_weight: torch.Tensor) -> Q8Blocks | None:
    """The head's 8-bit blocks, or None where the file's head is not Q8_0. Checked against the
    loaded head weight [vocab, hidden] (the checkpoint's dequantized copy): a mismatch (another
    conversion) raises ValueError."""
    tensors = read_gguf_tensors(gguf_path).tensors
    tensor = next((tensors[name] for name in HEAD_TENSORS if name in tensors), None)
    if tensor is None or tensor.type_name != "Q8_0":
        return None
    blocks = unpack_q8_0(np.asarray(tensor.data), int(tensor.shape[0]))
    if not torch.equal(blocks.dequantized(), head_weight.float()):
        raise ValueError(f"{gguf_path}: the head's 8-bit blocks do not match the converted "
                         f"checkpoint")
    return blocks
