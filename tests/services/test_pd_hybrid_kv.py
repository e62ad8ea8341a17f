"""PD on a model whose layers form several KV groups (kv_groups.py): the step messages carry a
block table per group, the prefill worker pushes each group's blocks (pages of every slot of a
block), and greedy tokens equal transformers'. Real workers: the cluster driver with
StepExecutors (model_cluster.py).

The window (256) is at least the context: until the attention kernels take the window the
engine caps the context at it, so the tokens check the per-group plumbing; which blocks a push
carries for a window shorter than the prompt is checked without a model
(test_cluster_scheduler.py: test_pd_window_group_pushes_only_the_blocks_its_window_reaches)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

from kvrelay.engine.model_runner import ModelRunner
from kvrelay.scheduler.messages import DECODE, PREFILL
from tests.services.cluster_driver import BLOCK_SIZE
from tests.services.model_cluster import ModelClusterDriver, model_worker_info

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             sliding_window=256)
CONFIGS = {
    # 1 global : 5 local, as Gemma 3: six groups of one slot
    "hybrid": lambda: Qwen3Config(**SMALL, num_hidden_layers=6, head_dim=16,
                                  use_sliding_window=True,
                                  layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    # a window on every layer: one group of every layer
    "mistral": lambda: MistralConfig(**SMALL, num_hidden_layers=2),
}
PROMPTS = {"a": [1] + list(range(10, 50)), "b": [1] + list(range(10, 42)) + [7, 8, 9]}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pd_greedy_tokens_match_hf_through_every_groups_push(tmp_path, name):
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    hf_model.save_pretrained(tmp_path)
    runner = ModelRunner(hf_model.config, tmp_path, torch.float32, torch.device("cpu"),
                         BLOCK_SIZE, 1, 0)
    assert runner.kv_layout.num_groups == (6 if name == "hybrid" else 1)
    driver = ModelClusterDriver(runner, [
        model_worker_info(runner, worker_id, role, 64, SMALL["vocab_size"], (2,))
        for worker_id, role in (("p0", PREFILL), ("d0", DECODE))])
    for request_id, prompt in PROMPTS.items():  # b shares a's first two blocks
        driver.submit(request_id, prompt, temperature=0.0, max_tokens=10, ignore_eos=True)
    driver.run()
    driver.check_deltas(ended=True)
    driver.check_accounting()
    driver.assert_quiescent()
    for request_id, prompt in PROMPTS.items():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10,
                                     min_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert driver.tokens(request_id) == expected.tolist(), (name, request_id)
