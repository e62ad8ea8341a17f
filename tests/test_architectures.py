"""Llama-family variants on tiny random checkpoints: Llama 3 rope scaling, Llama 2 style linear
scaling, Qwen2 (qkv bias), Mistral. Greedy float32 tokens must equal HF transformers' own."""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvrelay.engine import LLM, SamplingParams

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "llama3_rope_scaling": lambda: LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}),
    "llama2_linear_scaling": lambda: LlamaConfig(**SMALL, rope_scaling={
        "rope_type": "linear", "factor": 2.0}),
    "qwen2_qkv_bias": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=None),
}


def _checkpoint(tmp_path, model_dir, make_config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
    with torch.no_grad():  # random biases, so a dropped bias would change the output
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    return model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_variant_greedy_matches_hf(tmp_path, model_dir, name):
    hf_model = _checkpoint(tmp_path, model_dir, CONFIGS[name])
    if name == "qwen2_qkv_bias":
        assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    prompts = [[1, 5, 9, 200, 3000, 17] * k for k in (1, 4, 30)]  # the last is 180 tokens
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == expected, name


def test_model_from_the_local_hf_cache_by_repo_id(tmp_path, model_dir, monkeypatch):
    import huggingface_hub.constants as hub_constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    hf_model = _checkpoint(snapshot, model_dir, CONFIGS["llama3_rope_scaling"])
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = LLM(model="tiny-org/tiny-llama", dtype="float32", num_kv_blocks=16)
    prompt = [1, 5, 9, 200, 3000, 17]
    got = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)[0, len(prompt):].tolist()
    assert got == want
    with pytest.raises(ValueError, match="not in the local"):
        LLM(model="tiny-org/not-cached")
