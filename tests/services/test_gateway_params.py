"""OpenAI request fields mean what OpenAI says once they are the engine's SamplingParams."""
from __future__ import annotations

import json

from kvrelay.gateway.openai_params import chat_params, completion_params
from kvrelay.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvrelay.gateway.openai_serving import ChunkEncoder, sse

MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return chat_params(ChatCompletionRequest(messages=MESSAGES, **fields))


def test_chat_defaults_run_to_the_end_of_the_context():
    params = chat()
    assert params.max_tokens is None and params.logprobs is None and params.n == 1
    assert params.temperature == 1.0 and params.skip_special_tokens


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7


def test_chat_logprobs_map_to_top_k():
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).logprobs == 3
    assert chat(logprobs=False).logprobs is None


def test_nulls_mean_the_engine_default_and_values_pass_through():
    params = chat(temperature=None, top_p=0.5, top_k=-1, seed=7, stop="END",
                  stop_token_ids=[2], ignore_eos=True, min_tokens=2, presence_penalty=0.5,
                  frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.1, n=3)
    assert params.temperature == 1.0 and params.top_p == 0.5 and params.top_k == 0
    assert (params.seed, params.stop, params.stop_token_ids) == (7, ["END"], [2])
    assert params.ignore_eos and params.min_tokens == 2 and params.n == 3
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.min_p) == (1.2, 0.1)


def test_completions_default_to_16_tokens_and_take_logprobs_as_k():
    params = completion_params(CompletionRequest(prompt="Hi", logprobs=2, stop=["a", "b"]))
    assert (params.max_tokens, params.logprobs, params.stop) == (16, 2, ["a", "b"])


def test_sse_frames_are_one_json_line_each():
    frame = sse({"text": "ligne\nnouvelle 🚀"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2  # a newline in the text is escaped inside the JSON
    assert json.loads(frame[len(b"data: "):]) == {"text": "ligne\nnouvelle 🚀"}


def test_chunk_encoder_event_equals_the_whole_chunk_serialized():
    header = {"id": "chatcmpl-1", "created": 7, "model": "m", "object": "chat.completion.chunk",
              "usage": None}
    choice = {"index": 1, "delta": {"content": "é\"🚀"}, "finish_reason": None}
    event = ChunkEncoder(header).event(choice)
    assert event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[len(b"data: "):]) == {**header, "choices": [choice]}
