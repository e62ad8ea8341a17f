"""Tiny random checkpoints of each family, written with transformers' own config classes and
save_pretrained (seeded; float32), beside the default model's tokenizer files."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

WINDOW = 16  # shorter than the prompts, so the window changes the outputs
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gemma3_layers(count: int) -> list[str]:
    return ["full_attention" if (index + 1) % 3 == 0 else "sliding_attention"
            for index in range(count)]


CONFIGS = {
    # Qwen3: q/k norms; untied head; windows on the layers from max_window_layers on
    "qwen3": lambda: Qwen3Config(**COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                                 use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1),
    "qwen3_tied_yarn": lambda: Qwen3Config(**COMMON, num_hidden_layers=2,
                                           tie_word_embeddings=True, rope_parameters={
                                               "rope_type": "yarn", "factor": 4.0,
                                               "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 128}),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, num_hidden_layers=3, num_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_moe_unnormalised": lambda: Qwen3MoeConfig(**COMMON, num_hidden_layers=2,
                                                     num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32,
                                                     norm_topk_prob=False),
    "mixtral": lambda: MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=WINDOW),
    "gemma2": lambda: Gemma2Config(**COMMON, num_hidden_layers=4, sliding_window=WINDOW,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, num_hidden_layers=6, sliding_window=WINDOW,
                                       layer_types=_gemma3_layers(6), query_pre_attn_scalar=24,
                                       rope_parameters={
                                           "sliding_attention": {"rope_type": "default",
                                                                 "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "linear",
                                                              "factor": 8.0,
                                                              "rope_theta": 1000000.0}}),
    "phi3_longrope_partial": lambda: Phi3Config(
        **{**COMMON, "max_position_embeddings": 1024}, num_hidden_layers=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "original_max_position_embeddings": 256,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]}),
    "phi3_window": lambda: Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=WINDOW),
    "mistral_window": lambda: MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2_window": lambda: Qwen2Config(**COMMON, num_hidden_layers=2, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=0),
    "llama3": lambda: LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "rope_theta": 500000.0, "original_max_position_embeddings": 128}),
}


def write_checkpoint(name: str, folder: Path, tokenizer_dir: Path, seed: int = 0):
    """The HF model (float32, eval) after saving it and the tokenizer files into `folder`."""
    return write_model(CONFIGS[name](), folder, tokenizer_dir, seed)


def write_model(config, folder: Path, tokenizer_dir: Path, seed: int = 0):
    """write_checkpoint of a config given whole."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms off 1 and random biases, so a misplaced one shows
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.normal_(0.0 if "bias" in param_name else 0.1, 0.3)
    model.save_pretrained(folder)
    for file_name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file_name, folder / file_name)
    return model.eval()
