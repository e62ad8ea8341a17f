"""32 streaming requests at once through the PD stack all complete, each with exactly its tokens."""
from __future__ import annotations

import asyncio

import openai

from kvrelay.engine import SamplingParams
from tests.prompts import USER_MESSAGES

NUM_REQUESTS = 32
MAX_TOKENS = 16


def conversations() -> list[list[dict]]:
    # Short, all different (a numbered variation of each stock question).
    short = [m for m in USER_MESSAGES if len(m) < 200]
    return [[{"role": "user", "content": f"{short[i % len(short)]} ({i + 1})"}]
            for i in range(NUM_REQUESTS)]


async def stream_one(client: openai.AsyncOpenAI, model: str, messages: list[dict]):
    stream = await client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish_reason, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason, usage


async def stream_all(base_url: str, model: str) -> list:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                                  timeout=180) as client:
        return await asyncio.gather(*(stream_one(client, model, messages)
                                      for messages in conversations()))


def test_32_concurrent_streams_complete_with_greedy_text(pd_stack, model_id, offline_llm):
    results = asyncio.run(asyncio.wait_for(stream_all(pd_stack.base_url, model_id), 240))
    expected = offline_llm.chat(conversations(), SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for index, ((text, finish_reason, usage), reference) in enumerate(zip(results, expected)):
        assert finish_reason == "length", index
        assert usage.completion_tokens == MAX_TOKENS, index
        assert text == reference.outputs[0].text, index
