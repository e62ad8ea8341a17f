"""The hybrid KV layout through the offline LLM on tiny random checkpoints: layers in groups
(kv_groups.py) write and read their own blocks, and greedy float32 tokens equal transformers'.

Qwen3 takes windows per `layer_types`, as Gemma does. Windows here are longer than the
prompts, so the outputs check the per-group tables, slot mappings and metadata;
tests/families/ checks windows shorter than the prompts, test_kv_cache_windows.py the freeing."""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

from kvrelay.engine import LLM, SamplingParams

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
             eos_token_id=2)
LOCAL, GLOBAL = "sliding_attention", "full_attention"

CONFIGS = {
    # Gemma 3's 5 local : 1 global: one slot per block, 6 groups
    "qwen3_1_global_5_local": (lambda: Qwen3Config(
        **SMALL, use_sliding_window=True, num_hidden_layers=6, sliding_window=256,
        layer_types=[LOCAL] * 5 + [GLOBAL]),
        1, (256,) * 5 + (0,)),
    # alternating: two slots per block, one window group and one full group
    "qwen3_alternating": (lambda: Qwen3Config(
        **SMALL, use_sliding_window=True, num_hidden_layers=4, sliding_window=256,
        layer_types=[LOCAL, GLOBAL] * 2),
        2, (256, 0)),
    # Mistral: a window on every layer, one group of all layers
    "mistral_window": (lambda: MistralConfig(**SMALL, num_hidden_layers=3, sliding_window=256),
                       3, (256,)),
}


def _checkpoint(tmp_path, model_dir, make_config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    return model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_match_hf_through_the_groups_and_their_prefix_hits(tmp_path, model_dir,
                                                                         name):
    make_config, slots, windows = CONFIGS[name]
    hf_model = _checkpoint(tmp_path, model_dir, make_config)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=256)
    runner = llm.engine.runner
    assert runner.slots_per_block == slots and runner.kv_layout.windows == windows
    assert runner.kv_cache.shape[0] == slots
    prompts = [[1, 5, 9, 200, 3000, 17] * k for k in (1, 4, 30)]  # the last is 180 tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False)[0, len(prompt):].tolist()
                for prompt in prompts]
    for _ in range(2):  # the second round starts from prefix hits in every group
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected, name
    kv = llm.engine.scheduler.kv
    assert kv.stats.hits > 0 and kv.num_free_blocks == kv.pool.num_blocks


def test_fewer_slots_per_block_give_more_blocks_for_the_same_memory(tmp_path, model_dir):
    make_config, slots, _ = CONFIGS["qwen3_1_global_5_local"]
    _checkpoint(tmp_path, model_dir, make_config)
    runner = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=6 << 20).engine.runner
    # [slots, K/V, block_size 16, kv_heads 2, head_dim 16] in float32
    assert runner.bytes_per_block == slots * 2 * 16 * 2 * 16 * 4
    assert runner.num_blocks == (6 << 20) // runner.bytes_per_block
