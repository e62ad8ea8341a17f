"""Tool calling through the PD stack with the openai SDK: required and named calls always parse
and validate against the tool's schema, streamed deltas reassemble to the same calls, a tool
result round trip works, auto may answer in text, and bad tool requests are 400s."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.structured_schemas import validate

WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD_ARGS = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "Current weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": ADD_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "add": ADD_ARGS}
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 40.", "Is it raining in Tokyo?",
             "What is 7 plus 8?", "How warm is it in Lima, in fahrenheit?", "Sum 100 and -3.",
             "Weather for Oslo please.", "Compute 12 + 30."]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_calls(calls) -> list[tuple[str, dict]]:
    assert calls, "no tool call"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None, str]:
    """Reassemble OpenAI tool-call deltas by index (arguments may come in pieces)."""
    calls, finish, content = {}, None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    ordered = [calls[index] for index in sorted(calls)]
    return [(c["name"], json.loads(c["arguments"])) for c in ordered], finish, content


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_always_validate_streamed_or_not(pd_client, model_id,
                                                                  tool_choice):
    def args(question: str) -> dict:
        return dict(model=model_id, messages=ask(question), tools=TOOLS,
                    tool_choice=tool_choice, temperature=0, max_tokens=120)

    def whole(question: str) -> list[tuple[str, dict]]:
        choice = pd_client.chat.completions.create(**args(question)).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = check_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert {name for name, _ in calls} == {"add"}
        return calls

    def streamed(question: str) -> list[tuple[str, dict]]:
        calls, finish, content = streamed_calls(
            pd_client.chat.completions.create(stream=True, **args(question)))
        assert calls and finish == "tool_calls" and content == ""
        for name, arguments in calls:
            validate(arguments, SCHEMAS[name])
        return calls

    # Every question, both ways, in one batch: each call validates whatever its neighbours.
    with ThreadPoolExecutor(2 * len(QUESTIONS)) as pool:
        futures = [pool.submit(way, question) for question in QUESTIONS
                   for way in (whole, streamed)]
        [future.result() for future in futures]
    # One at a time (so both replies are computed by the same batch shapes): the streamed
    # deltas reassemble to exactly the reply's calls.
    for question in QUESTIONS[:2]:
        assert streamed(question) == whole(question)


def test_a_tool_result_round_trip(pd_client, model_id):
    messages = ask("What is the weather in Paris?")
    first = pd_client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS,
                                              tool_choice="required", temperature=0,
                                              max_tokens=120).choices[0].message
    [call] = first.tool_calls[:1]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
    reply = pd_client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS,
                                              tool_choice="none", temperature=0,
                                              max_tokens=40).choices[0]
    assert reply.message.content and not reply.message.tool_calls


def test_auto_may_answer_in_text_and_any_call_validates(pd_client, model_id):
    def reply(question: str):
        return pd_client.chat.completions.create(
            model=model_id, messages=ask(question), tools=TOOLS, temperature=0,
            max_tokens=60).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(reply, QUESTIONS[:4]))
    for choice in choices:
        if choice.message.tool_calls:
            check_calls(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content and not choice.message.content.startswith("<")


def test_n2_sampled_calls_each_validate(pd_client, model_id):
    response = pd_client.chat.completions.create(
        model=model_id, messages=ask("Add 3 and 4."), tools=TOOLS, tool_choice="required",
        n=2, temperature=1.0, seed=5, max_tokens=120)
    assert len(response.choices) == 2
    for choice in response.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nope"}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s(pd_stack, model_id, body, param):
    response = httpx.post(f"{pd_stack.base_url}/chat/completions", timeout=30, trust_env=False,
                          json={"model": model_id, "messages": ask("Hi"), **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
