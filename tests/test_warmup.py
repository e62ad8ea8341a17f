"""A worker's warm-up runs its role's step shapes on the real model, and leaves the engine
answering exactly as before (it only wrote K/V into blocks no sequence holds)."""
from __future__ import annotations

import pytest

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.models.packed_linear import PackedLinear
from kvrelay.engine.step_padding import bucket_sizes
from kvrelay.kernels.onednn_linear import onednn_packs_bf16
from kvrelay.worker import warmup


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=512)  # room for the 64-sequence decode shape


def _greedy(llm) -> list[int]:
    return llm.generate({"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]},
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_warm_up_runs_the_roles_shapes_and_changes_no_answer(llm, role, monkeypatch):
    before = _greedy(llm)
    shapes = []
    execute = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute",
                        lambda step, *a: shapes.append(len(step.sample_rows)) or execute(step))
    assert warmup.warm_up(llm.engine.runner, role) > 0
    prefill = [len(chunk) for chunk in warmup.PREFILL_CHUNKS]
    decode = list(warmup.DECODE_BATCHES)
    assert shapes == {"prefill": prefill, "decode": decode, "both": prefill + decode}[role]
    monkeypatch.undo()
    assert _greedy(llm) == before


def test_a_cache_too_small_for_a_shape_skips_it():
    assert warmup._items([(0, 512)] * 4, block_size=16, num_blocks=100) == []
    items = warmup._items([(64, 1)] * 2, block_size=16, num_blocks=100)
    assert [item.block_ids for item in items] == [[list(range(0, 5))], [list(range(5, 10))]]
    # two KV groups: each sequence a table per group, on blocks of its own
    items = warmup._items([(64, 1)] * 2, block_size=16, num_blocks=20, num_groups=2)
    assert [item.block_ids for item in items] == [[list(range(0, 5)), list(range(5, 10))],
                                                  [list(range(10, 15)), list(range(15, 20))]]
    assert warmup._items([(64, 1)] * 2, block_size=16, num_blocks=19, num_groups=2) == []


def test_only_bf16_on_cpu_warms_up(llm):
    runner = llm.engine.runner
    assert not warmup.needs_warm_up(runner)  # float32: nothing to JIT-compile
    bf16 = LLM(dtype="bfloat16", num_kv_blocks=512).engine.runner
    assert warmup.needs_warm_up(bf16)
    assert warmup.warm_up(bf16, "both") > 0


@pytest.mark.skipif(not onednn_packs_bf16(), reason="oneDNN packs bf16 weights only on CPUs "
                    "with AVX-512 or AVX-NE-CONVERT; elsewhere nothing pads or warms")
def test_bf16_warm_up_compiles_every_padded_row_count_of_the_first_layers_matmuls(monkeypatch):
    runner = LLM(dtype="bfloat16", num_kv_blocks=512).engine.runner
    calls = []
    onednn_matmul = PackedLinear.onednn_matmul
    monkeypatch.setattr(PackedLinear, "onednn_matmul",
                        lambda self, x: calls.append((id(self), x.shape[0])) or onednn_matmul(self, x))
    warmup.warm_up(runner, "decode")
    buckets = warmup.warm_bucket_rows(runner)
    assert buckets == bucket_sizes(runner.pad_from_rows, EngineConfig().max_num_batched_tokens)
    assert len(buckets) > 50 and buckets[-1] == EngineConfig().max_num_batched_tokens
    packed = [m for m in runner.model.layers[0].modules()
              if isinstance(m, PackedLinear) and m.packed_weight is not None]
    assert len(packed) == 4  # qkv, o, gate/up, down
    for linear in packed:
        assert [rows for owner, rows in calls if owner == id(linear)][-len(buckets):] == buckets
