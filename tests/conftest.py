"""Shared fixtures: the default model, converted once, and HF transformers' greedy reference."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Workers the tests start keep a 1 GiB KV cache each, not the share of the machine a served
# worker takes by default: many stacks come and go in one run, and each cache is committed at
# start. The default's sizing has its own tests (tests/services/test_kv_budget.py).
os.environ.setdefault("KVRELAY_KV_CACHE_MEMORY", "1GiB")

import pytest
import torch

from kvrelay.engine.model_loader import resolve_model_dir
from tests.variants import mark_variants


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def reference_logprobs(hf_model, prompt_ids: list[int],
                       completion_ids: list[int]) -> torch.Tensor:
    """HF float32's log-probabilities at each completion position given the prefix before it
    (teacher forcing, so one early difference does not count for the rest): [generated, vocab]."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1:-1].log_softmax(-1)


def below_best(reference: torch.Tensor, token_ids: list[int]) -> list[float]:
    """How many nats each chosen token lies below the reference's best at its position
    (0 where it is the reference's argmax); reference [generated, vocab]."""
    chosen = reference[torch.arange(len(token_ids)), torch.tensor(token_ids)]
    return (reference.max(-1).values - chosen).tolist()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, stopping at EOS like the engine does."""
    with torch.inference_mode():
        output = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                   do_sample=False, attention_mask=torch.ones(1, len(prompt_ids),
                                                                              dtype=torch.long))
    return output[0, len(prompt_ids):].tolist()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "variant: a second variant, run by make test-variants")


def pytest_collection_modifyitems(config, items) -> None:
    mark_variants(items)


@pytest.fixture
def hosts():
    """Two hosts on this machine: a second network namespace on a link of its own
    (tests/parallel/two_hosts.py), or a skip where none can be made."""
    from tests.parallel.two_hosts import two_hosts
    yield from two_hosts()
