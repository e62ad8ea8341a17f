"""Reasoning through a real stack (`--reasoning-parser deepseek_r1` and a test template whose
generation prompt opens <think>, so the reply starts inside it) with the openai SDK: reasoning
never lands in content, streamed or not; a JSON schema holds only after </think>; the Responses
API gives a reasoning item before the message and counts its tokens. The default model learns
to close the block from the conversation's earlier turns (few-shot)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import openai_client
from tests.e2e.stack import start_stack, stop_and_check
from tests.structured_schemas import validate

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "think_template.jinja"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SHOTS = [("A name and an age.", '{"name":"Ann","age":31}'), ("Another one.", '{"name":"Bob","age":40}'),
         ("One more.", '{"name":"Cy","age":22}')]


def conversation(question: str) -> list[dict]:
    messages = []
    for thought, answer in SHOTS:
        messages += [{"role": "user", "content": "Invent a person."},
                     {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"}]
    return messages + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    stack = start_stack("colocated", tmp_path_factory.mktemp("reasoning-stack"),
                        "--chat-template", str(TEMPLATE), "--reasoning-parser", "deepseek_r1")
    yield openai_client(stack)
    stop_and_check(stack)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.mark.parametrize("question", ["Invent a person.", "Invent an old person."])
def test_reasoning_is_split_off_and_the_schema_holds_after_it(client, model, question):
    args = dict(model=model, messages=conversation(question), temperature=0, max_tokens=80,
                response_format=SCHEMA_FORMAT)
    message = client.chat.completions.create(**args).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.strip() and "think>" not in reasoning
    validate(json.loads(message.content), PERSON)
    streamed_reasoning = streamed_content = ""
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)


def test_unconstrained_replies_keep_tags_out_of_content(client, model):
    message = client.chat.completions.create(
        model=model, messages=conversation("Invent a person."), temperature=0,
        max_tokens=40).choices[0].message
    assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
    assert message.model_extra["reasoning_content"] is not None


def test_responses_give_a_reasoning_item_then_the_message(client, model):
    args = dict(model=model, input=conversation("Invent a person."), temperature=0,
                max_output_tokens=80,
                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    response = client.responses.create(**args)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text.strip()
    validate(json.loads(response.output_text), PERSON)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with client.responses.stream(**args) as stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    reasoning = "".join(event.delta for event in events
                        if event.type == "response.reasoning_text.delta")
    assert reasoning == response.output[0].content[0].text
    assert events[-1].response.output_text == response.output_text


def test_reasoning_effort_reaches_a_template_that_reads_it(client, model, pd_client, model_id):
    messages = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    low = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                         reasoning_effort="low")
    assert low.usage.prompt_tokens > plain.usage.prompt_tokens  # the template's own turn
    effort = client.responses.create(model=model, input="Hi", max_output_tokens=1,
                                     reasoning={"effort": "high"})
    assert effort.reasoning.effort == "high"
    import openai
    with pytest.raises(openai.BadRequestError) as refused:  # the default template reads none
        pd_client.chat.completions.create(model=model_id, messages=messages, max_tokens=1,
                                          reasoning_effort="low")
    assert refused.value.body["param"] == "reasoning_effort"
