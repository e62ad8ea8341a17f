"""Tool calling in the JSON formats other models are trained on, through real stacks started with
a test template that teaches each (`--chat-template`; the tokenizer reads the format from it)
and the openai SDK: Llama 3's bare {"name", "parameters"} objects, Mistral's [TOOL_CALLS] list,
Qwen3-Coder's XML and Llama 3.2's pythonic list. Required and named calls validate against the schemas, streamed deltas (the name, then
the arguments in pieces) reassemble to the same calls, the Responses API streams argument
deltas too, and a tool result round trip renders with the template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.tokenizer.tool_render import template_inputs
from tests.e2e.conftest import openai_client
from tests.e2e.stack import start_stack, stop_and_check
from tests.e2e.test_tool_calls import SCHEMAS, TOOLS, ask, check_calls, streamed_calls

DATA = Path(__file__).resolve().parents[1] / "data"
TEMPLATES = {"llama3_json": DATA / "llama3_tools_template.jinja",
             "mistral": DATA / "mistral_tools_template.jinja",
             "qwen3_coder": DATA / "qwen3_coder_tools_template.jinja",
             "pythonic": DATA / "pythonic_tools_template.jinja"}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def stack_format(request, tmp_path_factory):
    stack = start_stack("colocated", tmp_path_factory.mktemp(f"{request.param}-stack"),
                        "--chat-template", str(TEMPLATES[request.param]))
    client = openai_client(stack)
    yield client, client.models.list().data[0].id, request.param
    stop_and_check(stack)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "add"}}])
def test_calls_validate_streamed_or_not(stack_format, tool_choice):
    client, model, _ = stack_format
    for question in ("Add 2 and 40.", "What is the weather in Paris?"):
        args = dict(model=model, messages=ask(question), tools=TOOLS, tool_choice=tool_choice,
                    temperature=0, max_tokens=120)
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = check_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert {name for name, _ in calls} == {"add"}
        streamed = streamed_calls(client.chat.completions.create(stream=True, **args))
        assert streamed == (calls, "tool_calls", "")


def test_responses_stream_argument_deltas(stack_format):
    client, model, _ = stack_format
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    with client.responses.stream(model=model, input="Add 2 and 40.", tools=tools,
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_output_tokens=80) as stream:
        events = list(stream)
    call = [item for item in events[-1].response.output if item.type == "function_call"][0]
    json.loads(call.arguments)
    deltas = [event.delta for event in events
              if event.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments and len(deltas) > 1


def test_a_tool_result_round_trip_renders_with_the_template(stack_format, tokenizer):
    client, model, fmt = stack_format
    messages = ask("What is the weather in Paris?")
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    name, arguments = check_calls([call])[0]
    assert name in SCHEMAS
    result = json.dumps({"temperature": 18})
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=20)
    rendered, tools = template_inputs(
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": first.content or "",
          "tool_calls": [{"name": name, "arguments": arguments}]},
         {"role": "tool", "content": result, "tool_call_id": call.id}], None, fmt)
    expected = tokenizer.apply_chat_template(rendered, tools=tools, tokenize=True,
                                             add_generation_prompt=True,
                                             chat_template=TEMPLATES[fmt].read_text())
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert reply.usage.prompt_tokens == len(expected)
