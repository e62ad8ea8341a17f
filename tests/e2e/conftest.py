"""Fixtures of the end-to-end tests: real stacks started through `kvrelay up`, and the greedy
references (HF transformers and the offline engine) that the stacks must reproduce.

The PD stack lives for the whole package; the colocated one starts only for the module that asks
for it; tests marked `breaks_stack` run last, on their own stack.
"""
from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest

from tests.conftest import hf_greedy
from tests.e2e.stack import RunningStack, start_stack, stop_and_check
from tests.prompts import USER_MESSAGES

MAX_NEW_TOKENS = 24


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "breaks_stack: kills part of its stack; runs last")


def pytest_collection_modifyitems(config, items) -> None:
    # Stable: everything else keeps its order, stack-breaking tests go to the end.
    items.sort(key=lambda item: item.get_closest_marker("breaks_stack") is not None)


@pytest.fixture(scope="package")
def pd_stack(tmp_path_factory) -> RunningStack:
    # The default topology runs with mutual TLS on every internal hop, and KV pages pushed over
    # gRPC (through TLS) rather than shm: every test on it checks the stack works that way, and
    # the greedy parity tests compare it with the plaintext colocated stack and with HF.
    stack = start_stack("pd", tmp_path_factory.mktemp("pd-stack"), "--tls",
                        "--kv-transport", "grpc")
    yield stack
    stop_and_check(stack)


@pytest.fixture(scope="module")
def colocated_stack(tmp_path_factory) -> RunningStack:
    stack = start_stack("colocated", tmp_path_factory.mktemp("colocated-stack"))
    yield stack
    stop_and_check(stack)


def openai_client(stack: RunningStack, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120,
                         **kwargs)


@pytest.fixture(scope="package")
def pd_client(pd_stack) -> openai.OpenAI:
    return openai_client(pd_stack)


@pytest.fixture(scope="package")
def model_id(pd_client) -> str:
    return pd_client.models.list().data[0].id


@dataclass
class GreedyCase:
    messages: list[dict]
    prompt_ids: list[int]  # the chat template rendered by HF's tokenizer
    hf_tokens: list[int]
    engine_tokens: list[int]
    text: str  # hf_tokens decoded
    finish_reason: str


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@pytest.fixture(scope="package")
def offline_llm():
    from kvrelay.engine import LLM
    return LLM(dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="package")
def greedy_cases(tokenizer, hf_model, offline_llm) -> list[GreedyCase]:
    from kvrelay.engine import SamplingParams
    cases = []
    for message in (USER_MESSAGES[0], USER_MESSAGES[2]):
        messages = [{"role": "user", "content": message}]
        prompt_ids = chat_prompt_ids(tokenizer, messages)
        hf_tokens = hf_greedy(hf_model, prompt_ids, MAX_NEW_TOKENS)
        [output] = offline_llm.generate({"prompt_token_ids": prompt_ids},
                                        SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS),
                                        use_tqdm=False)
        stopped = len(hf_tokens) < MAX_NEW_TOKENS or hf_tokens[-1] == tokenizer.eos_token_id
        cases.append(GreedyCase(messages, prompt_ids, hf_tokens, output.outputs[0].token_ids,
                                tokenizer.decode(hf_tokens, skip_special_tokens=True),
                                "stop" if stopped else "length"))
    return cases
