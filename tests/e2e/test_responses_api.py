"""OpenAI's Responses API through the PD stack with the openai SDK: text equal to chat's for the
same conversation, JSON held to a text.format schema, a function-call round trip (items passed
back, and the same through previous_response_id), the streamed event sequence in OpenAI's
order with argument deltas that join to the call, the store (retrieve, delete, store=false),
and 400s/404s that name the field."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_tool_calls import ADD_ARGS, SCHEMAS, WEATHER_ARGS
from tests.structured_schemas import validate

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER_ARGS},
         {"type": "function", "name": "add", "description": "Add two integers",
          "parameters": ADD_ARGS}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_text_equals_chat_for_the_same_conversation(pd_client, model_id):
    response = pd_client.responses.create(
        model=model_id, instructions="Answer briefly.", input="Name a color.",
        max_output_tokens=12, temperature=0)
    chat = pd_client.chat.completions.create(
        model=model_id, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name a color."}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    message, = response.output
    assert message.type == "message" and message.role == "assistant"
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_json_schema_text_format(pd_client, model_id):
    response = pd_client.responses.create(
        model=model_id, input="Describe a person as JSON.", temperature=0, max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert response.status == "completed", response
    validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def _calls(response) -> list[tuple[str, dict]]:
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_function_call_round_trip_by_items_and_by_previous_response_id(pd_client, model_id):
    question = [{"role": "user", "content": "Add 2 and 40."}]
    first = pd_client.responses.create(model=model_id, input=question, tools=TOOLS,
                                       tool_choice="required", temperature=0,
                                       max_output_tokens=60)
    calls = _calls(first)
    results = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"sum": 42}'}
               for call in calls]
    passed_back = [item.model_dump(exclude_none=True) for item in first.output]
    explicit = pd_client.responses.create(model=model_id, input=question + passed_back + results,
                                          tools=TOOLS, tool_choice="none", temperature=0,
                                          max_output_tokens=16, store=False)
    chained = pd_client.responses.create(model=model_id, previous_response_id=first.id,
                                         input=results, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_output_tokens=16)
    assert explicit.store is False and chained.previous_response_id == first.id
    assert explicit.usage.input_tokens == chained.usage.input_tokens
    assert explicit.output_text == chained.output_text
    assert all(item.type == "message" for item in chained.output)


def test_named_tool_choice(pd_client, model_id):
    response = pd_client.responses.create(
        model=model_id, input="What is the weather in Paris?", tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "name": "add"}, max_output_tokens=60)
    assert {call.name for call in _calls(response)} == {"add"}


MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added",
                  "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def _collapsed(types: list[str]) -> list[str]:
    """Runs of one delta type as one entry."""
    return [kind for index, kind in enumerate(types)
            if not (kind.endswith(".delta") and index and types[index - 1] == kind)]


def test_streamed_text_events_in_order(pd_client, model_id):
    args = dict(model=model_id, input="Name a color.", max_output_tokens=12, temperature=0)
    with pd_client.responses.stream(**args) as stream:
        events = list(stream)
    final = events[-1].response  # the SDK's get_final_response takes response.completed only
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert _collapsed(types)[:2] == ["response.created", "response.in_progress"]
    assert _collapsed(types)[2:-1] == MESSAGE_EVENTS
    assert types[-1] in ("response.completed", "response.incomplete")
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text == pd_client.responses.create(**args).output_text
    assert final.status == types[-1].split(".")[1]


def test_streamed_function_call_arguments_join_to_the_call(pd_client, model_id):
    with pd_client.responses.stream(model=model_id, input="Add 2 and 40.", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert _collapsed(types)[2:-1] == CALL_EVENTS
    assert types[-1] == "response.completed"
    call, = _calls(final)
    deltas = [event.delta for event in events
              if event.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    assert len(deltas) > 1  # the arguments came as they were generated


def test_store_retrieve_delete(pd_client, model_id):
    response = pd_client.responses.create(model=model_id, input="Hi", max_output_tokens=4,
                                          temperature=0)
    assert response.store is True
    assert pd_client.responses.retrieve(response.id).output_text == response.output_text
    pd_client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        pd_client.responses.retrieve(response.id)
    unstored = pd_client.responses.create(model=model_id, input="Hi", max_output_tokens=4,
                                          store=False)
    with pytest.raises(openai.NotFoundError) as missing:
        pd_client.responses.create(model=model_id, input="Go on",
                                   previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning"),  # the template reads none
    ({"input": "Hi", "reasoning": {"summary": "auto"}}, "reasoning"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "unknown_field": 1}, "unknown_field"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}]},
     "input"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
])
def test_bad_requests_name_the_field(pd_stack, body, param):
    with httpx.Client(base_url=pd_stack.base_url, timeout=60, trust_env=False) as client:
        reply = client.post("/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
