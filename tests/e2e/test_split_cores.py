"""`--shared-compute-steps split` (the default) on the real PD stack: while a long prompt
prefills in chunks, the decode worker steps beside the prefill worker, each on one share of the
cores, and every output is still the greedy one, with every KV block free afterwards."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from kvrelay.engine import SamplingParams
from kvrelay.stack.plan import usable_cpus
from tests.e2e.stack import metric_values
from tests.e2e.test_disconnect import all_blocks_free, describe
from tests.prompts import USER_MESSAGES, long_text

LONG_PROMPT_TOKENS = 900  # over the scheduler's long-prompt threshold (384): chunked
SHORT_MAX_TOKENS = 48
LONG_MAX_TOKENS = 4


def prompts(tokenizer) -> tuple[list[list[int]], list[int]]:
    short = [tokenizer.encode(message) for message in USER_MESSAGES[:4]]
    long = tokenizer.encode(long_text(60))[:LONG_PROMPT_TOKENS]
    assert len(long) == LONG_PROMPT_TOKENS
    return short, long


async def stream_text(client, model: str, prompt: list[int], max_tokens: int,
                      started: asyncio.Event | None = None) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, temperature=0,
                                             max_tokens=max_tokens, stream=True,
                                             extra_body={"ignore_eos": True})
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if started is not None:
            started.set()
    return text


async def short_and_long(base_url: str, model: str, short: list[list[int]],
                         long: list[int]) -> tuple[list[str], str]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                                  timeout=240) as client:
        started = [asyncio.Event() for _ in short]
        short_runs = [asyncio.create_task(stream_text(client, model, ids, SHORT_MAX_TOKENS, event))
                      for ids, event in zip(short, started)]
        await asyncio.gather(*(event.wait() for event in started))  # they decode now
        long_text_out = await stream_text(client, model, long, LONG_MAX_TOKENS)
        return await asyncio.gather(*short_runs), long_text_out


def greedy_texts(llm, prompts: list[list[int]], max_tokens: int) -> list[str]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [output.outputs[0].text for output in outputs]


@pytest.mark.skipif(usable_cpus() < 2, reason="one core cannot be split")
def test_decodes_step_beside_a_long_prefill_with_greedy_outputs(pd_stack, model_id, tokenizer,
                                                                 offline_llm):
    short, long = prompts(tokenizer)
    scheduler_metrics = pd_stack.service("scheduler")["metrics_url"]
    split_before = metric_values(scheduler_metrics, "kvrelay:worker_split_steps_total")
    short_out, long_out = asyncio.run(asyncio.wait_for(
        short_and_long(pd_stack.base_url, model_id, short, long), 300))

    assert short_out == greedy_texts(offline_llm, short, SHORT_MAX_TOKENS)
    assert long_out == greedy_texts(offline_llm, [long], LONG_MAX_TOKENS)[0]
    split_after = metric_values(scheduler_metrics, "kvrelay:worker_split_steps_total")
    # Both workers ran steps on a share of the cores during this test.
    assert len(split_after) == 2, split_after
    assert all(split_after[w] > split_before.get(w, 0) for w in split_after), split_after
    deadline = time.monotonic() + 5
    while not all_blocks_free(stats := pd_stack.scheduler_stats()):
        assert time.monotonic() < deadline, describe(stats)
        time.sleep(0.05)
