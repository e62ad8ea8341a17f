"""Allowed-token bitmasks for the sampler: packed int32 rows (backend.py's layout) unpacked into
a boolean mask over the vocabulary, applied to the logits before every other sampling step."""
from __future__ import annotations

import torch

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32 [R, W] -> bool [R, vocab_size], True where the token is allowed."""
    bits = (bitmask[:, :, None] >> _BIT_SHIFTS.to(bitmask.device)) & 1  # [R, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:  # tokens past the mask (a padded vocabulary): disallowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed


def apply_(logits: torch.Tensor, row_ids: list[int], bitmask: torch.Tensor) -> None:
    """logits [B, V] float32, edited in place: rows row_ids (one per bitmask row) keep only
    their allowed tokens, the others become -inf. On CPU one native pass over the bits
    (kernels/csrc/cpu_elementwise.cpp) where it is built; else unpacked with torch."""
    ops = _native_ops() if logits.device.type == "cpu" else None
    if ops is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        ops.apply_token_bitmask(logits, bitmask.to(torch.int32).contiguous(),
                                torch.tensor(row_ids, dtype=torch.long))
        return
    allowed = unpack(bitmask, logits.shape[1])  # [R, V]
    index = torch.tensor(row_ids, device=logits.device)
    rows = logits.index_select(0, index)
    rows.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, rows)


def _native_ops():
    from kvrelay.kernels.native_elementwise import elementwise_ops
    return elementwise_ops()
