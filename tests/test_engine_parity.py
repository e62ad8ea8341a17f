"""Greedy float32 outputs equal HF transformers' greedy generate, token for token, under every
scheduling configuration: batched, chunked prefill, prefix caching on/off, preemption, block sizes."""
from __future__ import annotations

import pytest

from kvrelay.engine import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.prompts import chat_conversations

MAX_NEW_TOKENS = 32  # past the first divergences seen while building; half the time of 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def prompt_token_ids(tokenizer):
    ids = []
    for conversation in chat_conversations(with_system=True):
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 tokenize=True)
        ids.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    assert max(len(p) for p in ids) > 800 and min(len(p) for p in ids) < 150
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompt_token_ids):
    return [hf_greedy(hf_model, ids, MAX_NEW_TOKENS) for ids in prompt_token_ids]


def _generate(llm: LLM, prompt_token_ids, params=GREEDY):
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
    return llm.generate(prompts, params, use_tqdm=False)


def _assert_matches(outputs, reference):
    for index, (output, expected) in enumerate(zip(outputs, reference)):
        got = output.outputs[0].token_ids
        assert got == expected, f"prompt {index}: diverged at token " \
            f"{next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))}"


def test_batched_greedy_matches_hf(prompt_token_ids, reference):
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20)
    _assert_matches(_generate(llm, prompt_token_ids), reference)


def test_chunked_prefill_32_token_budget(prompt_token_ids, reference):
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20, max_num_batched_tokens=32)
    _assert_matches(_generate(llm, prompt_token_ids), reference)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prefix_caching_with_shared_system_prompt(prompt_token_ids, reference,
                                                  enable_prefix_caching):
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20,
              enable_prefix_caching=enable_prefix_caching)
    first = _generate(llm, prompt_token_ids[:1])  # warms the cache with the system prompt
    rest = _generate(llm, prompt_token_ids[1:])
    _assert_matches(first + rest, reference)
    stats = llm.engine.scheduler.kv.stats
    cached = [output.num_cached_tokens for output in rest]
    if enable_prefix_caching:
        assert stats.hits > 0 and min(cached) >= 64, cached  # the system prompt is ~100 tokens
    else:
        assert stats.hits == 0 and max(cached) == 0


def test_tiny_kv_pool_preempts_and_still_matches(prompt_token_ids, reference):
    # Enough blocks for the longest prompt, far too few for all of them together; no prefix
    # sharing, so the running batch outgrows the pool while it decodes.
    llm = LLM(dtype="float32", num_kv_blocks=80, block_size=16, enable_prefix_caching=False)
    _assert_matches(_generate(llm, prompt_token_ids), reference)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 80


def test_block_size_32(prompt_token_ids, reference):
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20, block_size=32)
    _assert_matches(_generate(llm, prompt_token_ids), reference)


def test_n2_greedy_gives_two_identical_sequences(prompt_token_ids, reference):
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, n=2)
    outputs = _generate(llm, prompt_token_ids[:3], params)
    for output, expected in zip(outputs, reference[:3]):
        assert [o.token_ids for o in output.outputs] == [expected, expected]
