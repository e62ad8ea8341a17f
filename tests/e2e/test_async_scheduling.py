"""Async scheduling on the real PD stack: a greedy stream's decode steps are planned and sent
while the step before them runs, and its text is still the offline engine's, every block free
afterwards."""
from __future__ import annotations

import time

import openai

from kvrelay.engine import SamplingParams
from tests.e2e.stack import metric_values
from tests.e2e.test_disconnect import all_blocks_free, describe
from tests.prompts import USER_MESSAGES

MAX_TOKENS = 40
AHEAD = "kvrelay:worker_steps_planned_ahead_total"


def test_decode_steps_are_planned_ahead_and_the_text_is_the_greedy_one(pd_stack, model_id,
                                                                         tokenizer, offline_llm):
    prompt = tokenizer.encode(USER_MESSAGES[0])
    metrics_url = pd_stack.service("scheduler")["metrics_url"]
    before = sum(metric_values(metrics_url, AHEAD).values())
    client = openai.OpenAI(base_url=pd_stack.base_url, api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model=model_id, prompt=prompt, temperature=0,
                                       max_tokens=MAX_TOKENS, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    [expected] = offline_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert text == expected.outputs[0].text
    planned_ahead = sum(metric_values(metrics_url, AHEAD).values()) - before
    # The first token is the prefill worker's and the first decode step is planned in full;
    # most of the rest go ahead (a step planned in full after each other request's join).
    assert planned_ahead >= MAX_TOKENS // 2, planned_ahead
    deadline = time.monotonic() + 5
    while not all_blocks_free(stats := pd_stack.scheduler_stats()):
        assert time.monotonic() < deadline, describe(stats)
        time.sleep(0.05)
