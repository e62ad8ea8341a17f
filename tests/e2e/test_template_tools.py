"""Tool calling with a chat template that has its own (Hermes-style) tool support, through a
real stack started with `--chat-template` and the openai SDK: the prompt is the template's
rendering of the tools, calls and results (its token count says so), required and named calls
validate against the schemas, streamed deltas reassemble to the same calls, and a tool result
round trip works."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.tokenizer.tool_render import HERMES, template_inputs
from tests.e2e.conftest import openai_client
from tests.e2e.stack import start_stack, stop_and_check
from tests.e2e.test_tool_calls import SCHEMAS, TOOLS, ask, check_calls, streamed_calls

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "hermes_tools_template.jinja"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # Colocated: the template is the tokenizer's and the grammar the gateway's, whatever the
    # topology; one worker starts faster.
    stack = start_stack("colocated", tmp_path_factory.mktemp("hermes-stack"),
                        "--chat-template", str(TEMPLATE))
    yield openai_client(stack)
    stop_and_check(stack)


def _prompt_tokens(tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    conversation, tools = template_inputs(messages, tools, HERMES)
    rendered = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True,
                                             add_generation_prompt=True,
                                             chat_template=TEMPLATE.read_text())
    return len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "add"}}])
def test_calls_validate_and_the_prompt_is_the_templates(client, tokenizer, tool_choice):
    model = client.models.list().data[0].id
    args = dict(model=model, messages=ask("Add 2 and 40."), tools=TOOLS, tool_choice=tool_choice,
                temperature=0, max_tokens=120)
    response = client.chat.completions.create(**args)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert {name for name, _ in calls} == {"add"}
    assert response.usage.prompt_tokens == _prompt_tokens(
        tokenizer, [{"role": "user", "content": "Add 2 and 40."}], TOOLS)
    streamed, finish, content = streamed_calls(client.chat.completions.create(stream=True,
                                                                              **args))
    assert (streamed, finish, content) == (calls, "tool_calls", "")


def test_a_tool_result_round_trip_renders_with_the_template(client, tokenizer):
    model = client.models.list().data[0].id
    messages = ask("What is the weather in Paris?")
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    name, arguments = check_calls([call])[0]
    assert name in SCHEMAS
    result = json.dumps({"temperature": 18, "sky": "cloudy"})
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="auto", temperature=0, max_tokens=40)
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls
    rendered = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": first.content or "",
                 "tool_calls": [{"name": name, "arguments": arguments}]},
                {"role": "tool", "content": result, "tool_call_id": call.id}]
    assert reply.usage.prompt_tokens == _prompt_tokens(tokenizer, rendered, TOOLS)
