"""benchmarks/family_checkpoints.py: each family's config with the default model's dimensions,
and a seeded checkpoint saved with the source's tokenizer files."""
from __future__ import annotations

import json

import pytest

from benchmarks import family_checkpoints

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": True,
           "head_dim": 64, "model_type": "llama", "rope_parameters": {"rope_theta": 1e5}}


# the one family that changes a dimension: heads that 2 and 4 tensor-parallel ranks split
HEADS_CHANGED = {"llama_tp": {"num_attention_heads": 8, "num_key_value_heads": 2}}


@pytest.mark.parametrize("family", family_checkpoints.FAMILIES)
def test_every_family_keeps_the_default_models_dimensions(family):
    config = family_checkpoints.family_config(family, SMOLLM2)
    assert config.architectures == [family_checkpoints.ARCHITECTURES[family]]
    expected = SMOLLM2 | HEADS_CHANGED.get(family, {})
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "eos_token_id", "bos_token_id"):
        assert getattr(config, key) == expected[key], key
    assert config.head_dim == 64
    if family not in HEADS_CHANGED:  # these classes default to another head size
        assert config.head_dim * config.num_attention_heads == SMOLLM2["hidden_size"]
    assert config.tie_word_embeddings


def test_moe_activates_as_many_mlp_parameters_per_token_as_the_dense_model():
    config = family_checkpoints.family_config("qwen3_moe", SMOLLM2)
    assert config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.num_experts_per_tok * config.moe_intermediate_size == 1536
    assert not config.mlp_only_layers  # every layer routes


def test_gemma3_has_five_window_layers_to_each_global_one_and_its_twin_none():
    config = family_checkpoints.family_config("gemma3", SMOLLM2)
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 64
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.layer_types.count("full_attention") == 5
    full = family_checkpoints.family_config("gemma3_full", SMOLLM2)
    assert set(full.layer_types) == {"full_attention"}
    with pytest.raises(ValueError, match="unknown family"):
        family_checkpoints.family_config("llama4", SMOLLM2)


def test_a_checkpoint_is_seeded_bf16_and_carries_the_tokenizer_files(tmp_path):
    from safetensors import safe_open
    source = tmp_path / "source"
    source.mkdir()
    tiny = SMOLLM2 | {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 1,
                      "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 128}
    (source / "config.json").write_text(json.dumps(tiny))
    (source / "tokenizer.json").write_text('{"a tokenizer": 1}')
    (source / "chat_template.jinja").write_text("{{ messages }}")

    def tensors(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as weights:
            return {name: weights.get_tensor(name) for name in weights.keys()}

    first = tensors(family_checkpoints.write_checkpoint("qwen3", tmp_path / "a", source, 7))
    again = tensors(family_checkpoints.write_checkpoint("qwen3", tmp_path / "b", source, 7))
    other = tensors(family_checkpoints.write_checkpoint("qwen3", tmp_path / "c", source, 8))
    assert first.keys() == again.keys()
    assert all((first[name] == again[name]).all() for name in first)
    assert any(not (first[name] == other[name]).all() for name in first)
    assert {str(t.dtype) for t in first.values()} == {"torch.bfloat16"}
    assert any(name.endswith("q_norm.weight") for name in first)  # Qwen3's per-head q norm
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForCausalLM"] and saved["head_dim"] == 64
    assert (tmp_path / "a" / "tokenizer.json").read_text() == '{"a tokenizer": 1}'
    assert (tmp_path / "a" / "chat_template.jinja").read_text() == "{{ messages }}"
