"""Structured output on a PD stack whose decode worker has too few KV blocks for its batch:
sequences are preempted and recomputed, each sample's matcher stays with its tokens, and the
greedy outputs equal the offline engine's (float32), token for token."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvrelay.engine import SamplingParams
from kvrelay.engine.structured.spec import StructuredOutputs
from tests.e2e.conftest import openai_client
from tests.e2e.stack import start_stack, stop_and_check
from tests.e2e.test_disconnect import wait_until_all_free
from tests.structured_schemas import SCHEMAS, validate

NUM_KV_BLOCKS = 16  # 6 sequences of ~40 prompt + 96 output tokens need ~54 blocks of 16
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}},
             "required": ["text"], "additionalProperties": False}


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    stack = start_stack("pd", tmp_path_factory.mktemp("small-pool-stack"),
                        num_kv_blocks=NUM_KV_BLOCKS)
    yield stack
    stop_and_check(stack)


def test_preempted_constrained_samples_match_the_offline_engine(small_stack, offline_llm):
    schemas = [schema for _, schema in SCHEMAS[:2]] + [LONG_TEXT] * 4
    questions = [f"Example {index}, as JSON." for index in range(len(schemas))]
    client = openai_client(small_stack)
    model = client.models.list().data[0].id

    def ask(index: int):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": questions[index]}],
            temperature=0, max_tokens=96, logprobs=True,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": schemas[index]}}).choices[0]

    with ThreadPoolExecutor(len(schemas)) as pool:
        served = list(pool.map(ask, range(len(schemas))))
    assert small_stack.scheduler_stats().num_preemptions > 0
    offline = offline_llm.chat(
        [[{"role": "user", "content": question}] for question in questions],
        [SamplingParams(temperature=0, max_tokens=96,
                        structured_outputs=StructuredOutputs.json_schema(schema))
         for schema in schemas], use_tqdm=False)
    for schema, choice, reference in zip(schemas, served, offline):
        assert choice.message.content == reference.outputs[0].text
        assert len(choice.logprobs.content) == len(reference.outputs[0].token_ids)
        if choice.finish_reason == "stop":
            validate(json.loads(choice.message.content), schema)
    wait_until_all_free(small_stack)
