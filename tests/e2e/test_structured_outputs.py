"""Structured output through the PD stack with the openai SDK (and the public gRPC API): every
schema of the corpus validates, greedy constrained output equals the offline engine's, the
vLLM spellings work, bad specs are 400s, and an aborted constrained stream frees everything."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pydantic
import pytest

from kvrelay.api.kvrelay.v1 import common_pb2
from kvrelay.engine import SamplingParams
from kvrelay.engine.structured.spec import StructuredOutputs
from tests.e2e.grpc_api import chat_request, generate
from tests.e2e.test_disconnect import wait_until_all_free
from tests.structured_schemas import SCHEMAS, validate

MAX_TOKENS = 200


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def test_every_schema_validates_streamed_and_not(pd_client, model_id):
    def run(index: int):
        title, schema = SCHEMAS[index]
        args = dict(model=model_id, messages=ask(f"Give an example of {title} as JSON."),
                    temperature=0, max_tokens=MAX_TOKENS, response_format=schema_format(schema))
        if index % 2:  # half of them streamed
            text, finish = "", None
            for chunk in pd_client.chat.completions.create(stream=True, **args):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            return title, schema, text, finish
        choice = pd_client.chat.completions.create(**args).choices[0]
        return title, schema, choice.message.content, choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(len(SCHEMAS))))
    stopped = 0
    for title, schema, text, finish in results:
        assert finish in ("stop", "length"), (title, finish)
        if finish == "stop":
            validate(json.loads(text), schema)
            stopped += 1
    assert stopped >= len(SCHEMAS) - 2


def test_constrained_greedy_output_equals_the_offline_engine(pd_stack, offline_llm, tokenizer):
    cases = [(ask(f"Give an example of {title} as JSON."), StructuredOutputs.json_schema(schema))
             for title, schema in SCHEMAS[:6]]
    cases.append((ask("Yes or no?"), StructuredOutputs("choice", choices=("yes", "no"))))
    for messages, spec in cases:
        [offline] = offline_llm.chat(messages, SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec), use_tqdm=False)
        params = dict(temperature=0.0, max_tokens=MAX_TOKENS)
        request = chat_request(messages, **params)
        request.params.structured_outputs.CopyFrom(_spec_proto(spec))
        served = generate(pd_stack.grpc_address, request)
        assert served.token_ids[0] == offline.outputs[0].token_ids, spec


def _spec_proto(spec: StructuredOutputs) -> common_pb2.StructuredOutputs:
    from kvrelay.wire import structured_to_proto
    return structured_to_proto(spec)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


def test_sdk_parse_with_a_pydantic_model(pd_client, model_id):
    completion = pd_client.beta.chat.completions.parse(
        model=model_id, messages=ask("Invent a person."), response_format=Person,
        temperature=0, max_tokens=MAX_TOKENS)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra_body, check", [
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}},
     lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
    ({"guided_regex": "[a-c]{3}"}, lambda t: re.fullmatch("[a-c]{3}", t)),
    ({"structured_outputs": {"grammar": 'start: "go " DIR\nDIR: "north" | "south"'}},
     lambda t: t in ("go north", "go south")),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"]}}, lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
])
def test_vllm_spellings_and_json_object(pd_client, model_id, extra_body, check):
    choice = pd_client.chat.completions.create(
        model=model_id, messages=ask("Answer, please."), temperature=0, max_tokens=60,
        extra_body=extra_body).choices[0]
    assert choice.finish_reason == "stop" and check(choice.message.content), choice


def test_completions_take_constraints_too(pd_client, model_id):
    completion = pd_client.completions.create(
        model=model_id, prompt="The answer is", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert completion.choices[0].text in (" yes", " no")


def test_n2_with_a_seed_under_a_schema(pd_client, model_id):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10}},
              "required": ["word"], "additionalProperties": False}
    args = dict(model=model_id, messages=ask("A word as JSON."), n=2, temperature=1.0, seed=3,
                max_tokens=60, response_format=schema_format(schema))
    first = pd_client.chat.completions.create(**args)
    second = pd_client.chat.completions.create(**args)
    texts = sorted(c.message.content for c in first.choices)
    assert texts == sorted(c.message.content for c in second.choices)
    for choice in first.choices:
        if choice.finish_reason == "stop":
            validate(json.loads(choice.message.content), schema)


def test_logit_bias_and_allowed_token_ids(pd_client, model_id, tokenizer):
    token = tokenizer.encode("banana", add_special_tokens=False)[0]
    choice = pd_client.chat.completions.create(
        model=model_id, messages=ask("Hi"), max_tokens=3, temperature=0,
        logit_bias={str(token): 100}).choices[0]
    assert choice.message.content == tokenizer.decode([token]) * 3
    allowed = tokenizer.encode(" one two", add_special_tokens=False)
    choice = pd_client.chat.completions.create(
        model=model_id, messages=ask("Count"), max_tokens=4, temperature=0,
        extra_body={"allowed_token_ids": allowed}).choices[0]
    assert set(tokenizer.encode(choice.message.content, add_special_tokens=False)) <= set(allowed)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format", "foo"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
    ({"guided_grammar": "start: nope_rule"}, "guided_grammar", "nope_rule"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, None, "one output constraint"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "one"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1": 500}}, "logit_bias", "logit_bias"),
    ({"audio": {"voice": "x"}}, "audio", ""),
    ({"store": True}, "store", "store"),
])
def test_bad_constraints_are_400s(pd_stack, model_id, body, param, words):
    response = httpx.post(f"{pd_stack.base_url}/chat/completions", timeout=30, trust_env=False,
                          json={"model": model_id, "messages": ask("Hi"), **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_an_aborted_constrained_stream_frees_everything(pd_stack, model_id):
    schema = {"type": "object", "properties": {"story": {"type": "string"}},
              "required": ["story"]}
    client = openai.OpenAI(base_url=pd_stack.base_url, api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=model_id, messages=ask("Tell a very long story as JSON."), stream=True,
        max_tokens=2000, response_format=schema_format(schema))
    for index, _ in enumerate(stream):
        if index == 5:
            break
    stream.close()
    wait_until_all_free(pd_stack)
    choice = client.chat.completions.create(  # and the stack serves the next one
        model=model_id, messages=ask("ok?"), max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["ok"]}).choices[0]
    assert choice.message.content == "ok"


def test_the_grpc_client_takes_constraints(pd_stack):
    import asyncio

    from kvrelay.client import KvrelayClient

    async def ask_client():
        async with KvrelayClient(pd_stack.grpc_address) as client:
            chosen = await client.complete(messages=ask("Pick a color."), temperature=0,
                                           max_tokens=20,
                                           structured_outputs={"choice": ["cyan", "teal"]})
            as_json = await client.complete(messages=ask("A number as JSON."), temperature=0,
                                            max_tokens=40, structured_outputs={"json": {
                                                "type": "object", "properties": {"n": {
                                                    "type": "integer", "minimum": 0,
                                                    "maximum": 99}},
                                                "required": ["n"],
                                                "additionalProperties": False}})
            return chosen, as_json

    chosen, as_json = asyncio.run(ask_client())
    assert chosen.text in ("cyan", "teal")
    assert as_json.finish_reason == "stop"
    assert json.loads(as_json.text)["n"] in range(100)


def test_bad_words_through_the_gateway(pd_client, model_id):
    question = ask("What is the capital of France? Answer in one sentence.")
    plain = pd_client.chat.completions.create(model=model_id, messages=question, temperature=0,
                                              max_tokens=20).choices[0].message.content
    assert "Paris" in plain
    banned = pd_client.chat.completions.create(
        model=model_id, messages=question, temperature=0, max_tokens=20,
        extra_body={"bad_words": ["Paris"]}).choices[0].message.content
    assert banned != plain and "Paris" not in banned
