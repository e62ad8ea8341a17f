"""Greedy float32 output through the services equals HF transformers' and the offline engine's,
token for token, in both topologies, over REST (streaming and not) and over gRPC."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay.client import KvrelayClient
from tests.e2e.conftest import MAX_NEW_TOKENS, openai_client
from tests.e2e.grpc_api import chat_request, generate, token_ids_request


@pytest.fixture(params=["pd", "colocated"])
def stack(request):
    # The colocated stack starts only here, when its first test runs.
    return request.getfixturevalue(f"{request.param}_stack")


def test_grpc_token_ids_equal_hf_and_offline_engine(stack, greedy_cases):
    for case in greedy_cases:
        by_ids = generate(stack.grpc_address, token_ids_request(
            case.prompt_ids, temperature=0.0, max_tokens=MAX_NEW_TOKENS))
        by_chat = generate(stack.grpc_address, chat_request(
            case.messages, temperature=0.0, max_tokens=MAX_NEW_TOKENS))
        assert by_chat.prompt_token_ids == case.prompt_ids  # the same chat template
        for result in (by_ids, by_chat):
            assert result.token_ids[0] == case.hf_tokens
            assert result.token_ids[0] == case.engine_tokens
            assert result.text[0] == case.text
            assert result.usage.prompt_tokens == len(case.prompt_ids)
            assert result.usage.completion_tokens == len(case.hf_tokens)


def test_completions_with_token_id_prompt_equal_hf(stack, greedy_cases):
    client = openai_client(stack)
    model = client.models.list().data[0].id
    for case in greedy_cases:
        args = dict(model=model, prompt=case.prompt_ids, temperature=0,
                    max_tokens=MAX_NEW_TOKENS)
        full = client.completions.create(logprobs=0, **args)
        choice = full.choices[0]
        assert choice.text == case.text
        assert choice.finish_reason == case.finish_reason
        assert full.usage.completion_tokens == len(case.hf_tokens)
        assert full.usage.prompt_tokens == len(case.prompt_ids)
        # One logprob entry per generated token (the EOS that ended it included).
        assert len(choice.logprobs.token_logprobs) == len(case.hf_tokens)
        streamed = list(client.completions.create(stream=True, **args))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == case.text
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == \
            case.finish_reason


def test_chat_equals_hf_streaming_and_not(stack, greedy_cases):
    client = openai_client(stack)
    model = client.models.list().data[0].id
    for case in greedy_cases:
        args = dict(model=model, messages=case.messages, temperature=0,
                    max_tokens=MAX_NEW_TOKENS)
        full = client.chat.completions.create(**args)
        assert full.choices[0].message.content == case.text
        assert full.choices[0].finish_reason == case.finish_reason
        assert full.usage.prompt_tokens == len(case.prompt_ids)
        assert full.usage.completion_tokens == len(case.hf_tokens)
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **args))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(pieces) == case.text
        assert chunks[-1].usage.completion_tokens == len(case.hf_tokens)


def test_python_client_gives_hf_tokens(stack, greedy_cases):
    async def run_cases():
        results = []
        async with KvrelayClient(stack.grpc_address) as client:
            for case in greedy_cases:
                completion = await client.chat(case.messages, temperature=0.0,
                                               max_tokens=MAX_NEW_TOKENS)
                streamed = [chunk async for chunk in client.generate(
                    prompt_token_ids=case.prompt_ids, temperature=0.0,
                    max_tokens=MAX_NEW_TOKENS)]
                results.append((completion, streamed))
        return results

    for case, (completion, streamed) in zip(greedy_cases, asyncio.run(run_cases())):
        choice = completion.choices[0]
        assert completion.prompt_token_ids == case.prompt_ids
        assert choice.token_ids == case.hf_tokens and choice.text == case.text
        assert choice.finish_reason == case.finish_reason
        assert completion.usage.completion_tokens == len(case.hf_tokens)
        assert [t for chunk in streamed for t in chunk.token_ids] == case.hf_tokens
        assert "".join(chunk.text for chunk in streamed) == case.text
