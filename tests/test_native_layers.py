"""The bf16 CPU model with its native ops (fused add + norm, rope, SiLU) computes what the same
model computes with torch's ops, up to bf16 rounding: one prompt's logits, every position."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrelay.engine import LLM, SamplingParams

PROMPT = [1, 504, 3458, 282, 4649, 314, 29, 7, 2085, 1790, 28, 957, 253, 1928] * 6  # 84 tokens


def _logits(runner, token_ids: list[int]) -> torch.Tensor:
    """Prefill `token_ids` in one step and return every position's logits [T, V]."""
    num_blocks = -(-len(token_ids) // runner.block_size)
    item = SimpleNamespace(request=SimpleNamespace(num_computed_tokens=0, all_token_ids=token_ids,
                                                   params=SamplingParams(), adapter_id=0),
                           num_new_tokens=len(token_ids), block_ids=[list(range(num_blocks))],
                           draft_token_ids=[], samples=True)
    step = runner.prepare([item])
    step.logits_indices = torch.arange(len(token_ids))
    return runner.execute(step)


def test_native_ops_match_torch_ops_in_bf16():
    runner = LLM(dtype="bfloat16", num_kv_blocks=16, int4_max_tokens=0).engine.runner
    model = runner.model
    if model.norm.native is None:
        pytest.skip("no native CPU ops here")
    native_ops = model.norm.native
    native = _logits(runner, PROMPT)
    model.use_native_cpu_ops_(None)
    try:
        eager = _logits(runner, PROMPT)
    finally:
        model.use_native_cpu_ops_(native_ops)
    assert native.shape == eager.shape == (len(PROMPT), model.config.vocab_size)
    # bf16 rounding of a different summation order, carried through 30 layers: small, and the
    # top token agrees nearly everywhere.
    scale = eager.abs().max()
    assert (native - eager).abs().max() < 0.05 * scale
    assert (native.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.95
