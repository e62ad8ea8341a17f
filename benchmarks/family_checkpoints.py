"""Random checkpoints of other model families with the default model's dimensions, so that
kvrelay and the peers can be timed on each family's own architecture without model weights.

    python -m benchmarks.family_checkpoints --family qwen3|gemma3|gemma3_full|qwen3_moe|llama|llama_gptq|llama_awq --out DIR

The dimensions (hidden 576, 30 layers, 9 heads of 64, 3 KV heads, MLP 1536, vocabulary 49152)
are read from the directory kvrelay converts the default GGUF into, and its tokenizer and chat
template are copied in, so every server tokenizes the same prompts into the same tokens. Each
family's own transformers config class sets the rest of the architecture:
- qwen3: q/k RMSNorm per head, tied head.
- gemma3: Gemma3ForCausalLM (text only), five sliding-window layers (window 512) to one global,
  each kind with its own rope base; `gemma3_full` is the same model with every layer global,
  the full-attention baseline of the long-context workload (benchmarks/long_context.py).
- qwen3_moe: 8 experts, top 2, each expert's MLP half the dense one (768), so a token's active
  MLP parameters are the dense model's.
- llama: the default model's own architecture with random bf16 weights, the baseline of the
  per-family decode-step timing (benchmarks/family_steps.py): the Llama path of a safetensors
  checkpoint at the same dimensions and FLOPs.
- llama_gptq, llama_awq: that model's layer linears quantized to 4 bits in GPTQ's layout
  (symmetric, group 64, no act-order: what GPTQ releases of small models use, 576 inputs being
  no whole number of 128-groups) or AWQ's GEMM layout (group 64, zero points), by the reference
  quantizer of tests/quantized/int4_writer.py; embeddings and norms stay float32.
- llama_tp: llama with 8 query heads and 2 KV heads, which 2 and 4 tensor-parallel ranks split
  (benchmarks/tensor_parallel.py).
head_dim is set to 64 everywhere: these families' config classes default to another head size
than hidden / heads. Weights are seeded (torch's default initialisation) and saved in bfloat16.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

FAMILIES = ("qwen3", "gemma3", "gemma3_full", "qwen3_moe", "llama", "llama_gptq", "llama_awq",
            "llama_tp")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "gemma3_full": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "llama": "LlamaForCausalLM", "llama_gptq": "LlamaForCausalLM",
                 "llama_awq": "LlamaForCausalLM", "llama_tp": "LlamaForCausalLM"}
INT4_GROUP = 64
HEAD_DIM = 64
GEMMA_WINDOW = 512
GEMMA_LAYERS_PER_GLOBAL = 6  # Gemma 3's 5:1 pattern: every sixth layer attends to everything
NUM_EXPERTS = 8
EXPERTS_PER_TOKEN = 2
# The tokenizer and chat template files of the default model's directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def base_dims(config: dict) -> dict:
    """The dimensions every family takes from the default model's config.json."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    return {key: config[key] for key in keys if key in config}


def gemma_layer_types(num_layers: int, all_global: bool = False) -> list[str]:
    """Five sliding layers, then a global one, repeated (the last layer of a full group of
    six is global)."""
    return ["full_attention" if all_global or (index + 1) % GEMMA_LAYERS_PER_GLOBAL == 0
            else "sliding_attention" for index in range(num_layers)]


def family_config(family: str, base: dict):
    """The family's transformers config with the default model's dimensions."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    dims = base_dims(base) | {"head_dim": HEAD_DIM, "architectures": [ARCHITECTURES[family]]}
    if family == "qwen3":
        return Qwen3Config(**dims)
    if family in ("llama", "llama_gptq", "llama_awq"):
        return LlamaConfig(**dims)
    if family == "llama_tp":  # heads that 2 and 4 ranks split (the default model's 9 do not)
        return LlamaConfig(**dims | {"num_attention_heads": 8, "num_key_value_heads": 2})
    if family in ("gemma3", "gemma3_full"):
        return Gemma3TextConfig(
            **dims, sliding_window=GEMMA_WINDOW, query_pre_attn_scalar=HEAD_DIM,
            layer_types=gemma_layer_types(dims["num_hidden_layers"], family == "gemma3_full"))
    if family == "qwen3_moe":
        expert_size = dims["intermediate_size"] // EXPERTS_PER_TOKEN
        return Qwen3MoeConfig(**dims, num_experts=NUM_EXPERTS,
                              num_experts_per_tok=EXPERTS_PER_TOKEN,
                              moe_intermediate_size=expert_size, norm_topk_prob=True)
    raise AssertionError(family)  # every name in FAMILIES is built above


def write_checkpoint(family: str, out: Path, source: Path, seed: int = 0) -> Path:
    """Build the family's model from seeded random weights and save it (bf16) with the source
    directory's tokenizer files; returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM
    config = family_config(family, json.loads((source / "config.json").read_text()))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in ("llama_gptq", "llama_awq"):
        _write_int4(model, family, out, source, seed)
    else:
        model.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists() and not (out / name).exists():
            shutil.copyfile(source / name, out / name)
    return out


def _write_int4(model, family: str, out: Path, source: Path, seed: int) -> None:
    from tests.quantized.int4_writer import Format, write_int4_checkpoint
    fmt = Format("gptq", INT4_GROUP, sym=True) if family == "llama_gptq" \
        else Format("awq", INT4_GROUP)
    write_int4_checkpoint(model, fmt, out, source, seed)


def default_source() -> Path:
    from kvrelay.engine.model_loader import resolve_model_dir
    return resolve_model_dir(None)


def ensure_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    """`out`, written once: an existing checkpoint there is used as it is."""
    if not (out / "config.json").exists():
        write_checkpoint(family, out, default_source(), seed)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", type=Path, default=None,
                        help="where the dimensions and tokenizer come from (default: the "
                             "default model's converted directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_checkpoint(args.family, args.out, args.source or default_source(), args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
