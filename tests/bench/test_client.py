"""What `bench serve` sends to each kind of server, and how it reads their streams."""
from __future__ import annotations

import json

from kvrelay.bench.client import ServerOptions, _on_line, request_body
from kvrelay.bench.records import RequestRecord
from kvrelay.bench.workloads import BenchRequest

CHAT = BenchRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=16)


def test_openai_style_servers_get_ignore_eos_and_usage():
    path, body = request_body(CHAT, ServerOptions("http://127.0.0.1:9/v1/", model="m"))
    assert path == "/v1/chat/completions"
    assert body == {"model": "m", "messages": CHAT.messages, "max_tokens": 16,
                    "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}


def test_transformers_serve_gets_min_new_tokens_instead_of_ignore_eos():
    _, body = request_body(CHAT, ServerOptions("http://x", backend="transformers"))
    assert "ignore_eos" not in body and "model" not in body
    assert json.loads(body["generation_config"]) == {
        "min_new_tokens": 16, "max_new_tokens": 16, "do_sample": False}


def test_prompts_go_to_completions_with_their_extra_fields():
    request = BenchRequest(prompt="Once", max_tokens=4, extra={"top_k": 5})
    path, body = request_body(request, ServerOptions("http://x", ignore_eos=False))
    assert path == "/v1/completions"
    assert body["prompt"] == "Once" and body["top_k"] == 5 and "ignore_eos" not in body


def test_base_url_forms():
    assert ServerOptions("http://h:1/v1").base_url == "http://h:1"
    assert ServerOptions("http://h:1/").base_url == "http://h:1"


def test_stream_lines():
    record = RequestRecord(0)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert not _on_line("data: " + json.dumps(role), record, 0.1)  # no token yet
    assert not _on_line(": keep-alive comment", record, 0.2)
    assert _on_line('data: {"choices": [{"delta": {"content": "a"}}]}', record, 0.3)
    assert _on_line('data:{"choices": [{"text": "b"}]}', record, 0.4)
    assert _on_line('data: {"choices": [{"delta": {"reasoning_content": "c"}}]}', record, 0.5)
    assert not _on_line('data: {"choices": [], "usage": {"prompt_tokens": 3, '
                        '"completion_tokens": 9}}', record, 0.6)
    assert not _on_line("data: [DONE]", record, 0.7)
    assert record.token_times_s == [0.3, 0.4, 0.5]
    assert record.output_tokens == 9 and record.prompt_tokens == 3 and record.usage_reported
    _on_line('data: {"error": {"message": "boom"}}', record, 0.8)
    assert "boom" in record.error
