"""LoRA on the other families, float32, tiny random checkpoints: kvrelay's greedy tokens equal
transformers + peft's for an adapter made with peft on each (Phi-3's on its fused qkv_proj and
gate_up_proj; the mixture-of-experts families' on attention), beside base requests in the same
batch."""
from __future__ import annotations

import pytest
import torch

from kvrelay.engine import LLM, SamplingParams
from tests.families.checkpoints import write_checkpoint
from tests.lora.adapters import ALL_TARGETS, AdapterSpec, make_adapter

NEW_TOKENS = 24
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 7, [1] + list(range(100, 230, 3))]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {"qwen3": ALL_TARGETS, "gemma3": ALL_TARGETS, "gemma2": ALL_TARGETS,
           "phi3_window": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
           "mixtral": ATTENTION, "qwen3_moe": ATTENTION}


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_family_adapter_matches_peft(family, tmp_path, model_dir):
    base = write_checkpoint(family, tmp_path / "model", model_dir)
    peft_model = make_adapter(base, AdapterSpec(rank=8, targets=TARGETS[family], seed=5),
                              tmp_path / "adapter")
    expected = [_greedy(peft_model, prompt) for prompt in PROMPTS]
    base_expected = [_greedy(base, prompt) for prompt in PROMPTS[:1]]
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", num_kv_blocks=256,
              enable_lora=True, lora_modules={"tuned": str(tmp_path / "adapter")})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + PROMPTS[:1]], params,
                           use_tqdm=False, lora=["tuned", "tuned", None])
    got = [list(output.outputs[0].token_ids) for output in outputs]
    assert got[:2] == expected
    assert got[2:] == base_expected
    assert expected[0] != base_expected[0]  # the adapter changes what the model says
