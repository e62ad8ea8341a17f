"""Three random adapters on the default model (several ranks and target sets), and what
transformers + peft generate with each: the references every LoRA test compares against."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy
from tests.lora.adapters import ALL_TARGETS, AdapterSpec, make_adapter
from tests.prompts import chat_conversations

MAX_NEW_TOKENS = 12
SPECS = {
    "all-r8": AdapterSpec(rank=8, targets=ALL_TARGETS, alpha=16, seed=1),
    "qv-r16-rs": AdapterSpec(rank=16, targets=("q_proj", "v_proj"), alpha=8, rslora=True,
                             seed=2),
    "o-down-r4": AdapterSpec(rank=4, targets=("o_proj", "down_proj"), alpha=32,
                             layers=(0, 3, 7, 11, 20), seed=3),
}


@pytest.fixture(scope="session")
def lora_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for conversation in chat_conversations()[:2]:  # short: every test runs them in float32
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 tokenize=True)
        prompts.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    return prompts


@pytest.fixture(scope="session")
def lora_adapters(hf_model, tmp_path_factory) -> dict[str, tuple[str, object]]:
    """name -> (PEFT directory, the peft model holding the adapter)."""
    root = tmp_path_factory.mktemp("lora")
    return {name: (str(root / name), make_adapter(hf_model, spec, root / name))
            for name, spec in SPECS.items()}


@pytest.fixture(scope="session")
def lora_references(hf_model, lora_adapters, lora_prompts) -> dict[str | None, list[list[int]]]:
    """Adapter name (None: the base) -> per prompt, transformers' greedy tokens."""
    references = {None: [hf_greedy(hf_model, ids, MAX_NEW_TOKENS) for ids in lora_prompts]}
    for name, (_, peft_model) in lora_adapters.items():
        with torch.inference_mode():
            references[name] = [hf_greedy(peft_model, ids, MAX_NEW_TOKENS)
                                for ids in lora_prompts]
    return references
