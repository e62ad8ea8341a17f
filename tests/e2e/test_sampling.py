"""Sampling and output options through the PD stack: n, seed, stop strings and token ids,
logprobs, echo, usage, multi-byte text."""
from __future__ import annotations

import math

import pytest
import torch

from kvrelay.engine import SamplingParams
from tests.e2e.conftest import MAX_NEW_TOKENS, chat_prompt_ids
from tests.e2e.grpc_api import generate, token_ids_request

STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def by_index(choices):
    return sorted(choices, key=lambda choice: choice.index)


def test_n2_gives_two_choices_reproducible_by_seed(pd_client, model_id):
    args = dict(model=model_id, messages=STORY, n=2, temperature=1.0, seed=1234,
                max_tokens=MAX_NEW_TOKENS, logprobs=True)
    first, second = (pd_client.chat.completions.create(**args) for _ in range(2))
    texts = [choice.message.content for choice in by_index(first.choices)]
    assert [choice.index for choice in by_index(first.choices)] == [0, 1]
    assert texts == [choice.message.content for choice in by_index(second.choices)]
    assert texts[0] != texts[1]  # two samples, not one sample twice
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    streamed = {0: "", 1: ""}
    for chunk in pd_client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


def test_same_seed_same_text_other_seed_other_text(pd_client, model_id):
    def sample(seed: int) -> str:
        return pd_client.completions.create(model=model_id, prompt="Once upon a time",
                                            temperature=1.0, seed=seed,
                                            max_tokens=MAX_NEW_TOKENS).choices[0].text
    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_stop_string_ends_the_text_before_it(pd_client, model_id, greedy_cases):
    case = next(c for c in greedy_cases if len(c.text) > 40)
    start = len(case.text) // 2
    stop = case.text[start:start + 4]
    expected = case.text[:case.text.index(stop)]
    args = dict(model=model_id, messages=case.messages, temperature=0,
                max_tokens=MAX_NEW_TOKENS, stop=[stop])
    full = pd_client.chat.completions.create(**args)
    assert full.choices[0].message.content == expected
    assert full.choices[0].finish_reason == "stop"
    chunks = list(pd_client.chat.completions.create(stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_stop_token_id_ends_generation_after_that_token(pd_stack, pd_client, model_id,
                                                        greedy_cases, offline_llm):
    case = greedy_cases[0]
    stop_token = case.hf_tokens[5]
    end = case.hf_tokens.index(stop_token) + 1
    result = generate(pd_stack.grpc_address, token_ids_request(
        case.prompt_ids, temperature=0.0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=[stop_token]))
    assert result.token_ids[0] == case.hf_tokens[:end]
    assert result.finish_reason[0] == "FINISH_REASON_STOP"
    [offline] = offline_llm.generate(
        {"prompt_token_ids": case.prompt_ids}, SamplingParams(
            temperature=0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=[stop_token]),
        use_tqdm=False)
    rest = pd_client.completions.create(
        model=model_id, prompt=case.prompt_ids, temperature=0, max_tokens=MAX_NEW_TOKENS,
        extra_body={"stop_token_ids": [stop_token]})
    assert rest.choices[0].finish_reason == "stop"
    assert rest.usage.completion_tokens == end
    assert rest.choices[0].text == offline.outputs[0].text


def hf_token_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log p(output token i | everything before it), from one HF forward pass."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return [logprobs[i, token].item() for i, token in enumerate(output_ids)]


def test_chat_top_logprobs_shape_and_values(pd_client, model_id, greedy_cases, hf_model):
    case = greedy_cases[0]
    response = pd_client.chat.completions.create(
        model=model_id, messages=case.messages, temperature=0, max_tokens=MAX_NEW_TOKENS,
        logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == len(case.hf_tokens)
    expected = hf_token_logprobs(hf_model, case.prompt_ids, case.hf_tokens)
    for entry, hf_logprob in zip(content, expected):
        assert len(entry.top_logprobs) == 3
        top = [alt.logprob for alt in entry.top_logprobs]
        assert top == sorted(top, reverse=True) and top[0] <= 0.0
        # Greedy: the sampled token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert math.isclose(entry.logprob, top[0], abs_tol=1e-5)
        assert math.isclose(entry.logprob, hf_logprob, abs_tol=2e-3)


def test_completions_logprobs_shape_and_values(pd_client, model_id):
    response = pd_client.completions.create(model=model_id, prompt="The capital of France is",
                                            temperature=0, max_tokens=12, logprobs=2)
    choice = response.choices[0]
    logprobs = choice.logprobs
    num_tokens = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == num_tokens
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs):
        assert len(top) >= 2 and logprob <= 0.0
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-5)
        assert top[token] == pytest.approx(logprob, abs=1e-5)


def test_echo_returns_prompt_then_completion(pd_client, model_id):
    prompt = "The capital of France is"
    args = dict(model=model_id, prompt=prompt, temperature=0, max_tokens=8)
    plain = pd_client.completions.create(**args).choices[0].text
    echoed = pd_client.completions.create(echo=True, **args).choices[0].text
    assert echoed == prompt + plain


def test_usage_counts_the_rendered_chat_prompt(pd_client, model_id, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    response = pd_client.chat.completions.create(model=model_id, messages=messages,
                                                 temperature=0, max_tokens=10, logprobs=True)
    assert response.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, messages))
    assert response.usage.completion_tokens == len(response.choices[0].logprobs.content)
    assert response.usage.total_tokens == \
        response.usage.prompt_tokens + response.usage.completion_tokens


@pytest.mark.parametrize("request_text", ["Translate to Chinese: I love my cat.",
                                          "Reply only with emojis: happy birthday!"])
def test_multibyte_text_streams_whole_characters(pd_client, model_id, tokenizer, offline_llm,
                                                 request_text):
    messages = [{"role": "user", "content": request_text}]
    [offline] = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS),
                                 use_tqdm=False)
    expected = tokenizer.decode(offline.outputs[0].token_ids, skip_special_tokens=True)
    # The case only tests something if characters span several tokens.
    assert any(ord(char) >= 0x800 for char in expected) and "\ufffd" not in expected
    args = dict(model=model_id, messages=messages, temperature=0, max_tokens=MAX_NEW_TOKENS)
    full = pd_client.chat.completions.create(**args)
    assert full.choices[0].message.content == expected
    pieces = [c.choices[0].delta.content or "" for c in
              pd_client.chat.completions.create(stream=True, **args) if c.choices]
    assert "".join(pieces) == expected
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character
