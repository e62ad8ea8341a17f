"""The registry picks a family by `architectures` and refuses anything else by name."""
from __future__ import annotations

import json

import pytest

from kvrelay.engine import LLM
from kvrelay.engine.models import gemma3, llama, mixtral, qwen3_moe
from kvrelay.engine.models.registry import family_of, supported_architectures


def test_families_by_architecture_then_model_type():
    assert family_of({"architectures": ["Qwen3MoeForCausalLM"]}) is qwen3_moe
    assert family_of({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}) \
        is gemma3
    assert family_of({"architectures": ["Foo", "MixtralForCausalLM"]}) is mixtral
    assert family_of({"model_type": "mistral"}) is llama  # a config naming no architecture


def test_unsupported_architecture_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}))
    with pytest.raises(ValueError) as refused:
        LLM(model=str(tmp_path))
    message = str(refused.value)
    assert "DeepseekV3ForCausalLM is not supported" in message
    for name in ("Gemma3ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"):
        assert name in message
    assert supported_architectures() == sorted(supported_architectures())
