"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Servers differ in what they accept beyond the OpenAI schema: kvrelay, vLLM and llama-server take
`ignore_eos` (generate exactly max_tokens), while `transformers serve` answers 422 to any field it
does not know and is told the same through its `generation_config` field (min_new_tokens). All of
them send usage in the last chunk when asked with `stream_options.include_usage`; a server that
does not gets its output tokens counted as content chunks.

The client shares the machine with the server it measures in most runs here, so it is kept
lean: aiohttp (a C HTTP parser) on uvloop spends about a third of the CPU per streamed token
that httpx's pure-Python HTTP/1.1 parser did, and every server under test gets that CPU back.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp

from kvrelay.bench.records import RequestRecord
from kvrelay.bench.workloads import BenchRequest

BACKENDS = ("openai", "transformers")


@dataclass(slots=True)
class ServerOptions:
    base_url: str                 # http://host:port, without /v1
    model: str | None = None
    backend: str = "openai"
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}")
        self.base_url = normalize_base_url(self.base_url)


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def request_body(request: BenchRequest, options: ServerOptions) -> tuple[str, dict]:
    """The endpoint path and JSON body for one request."""
    body: dict = {"max_tokens": request.max_tokens, "temperature": options.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if options.model:
        body["model"] = options.model
    if request.messages is not None:
        path, body["messages"] = "/v1/chat/completions", request.messages
    else:
        path, body["prompt"] = "/v1/completions", request.prompt
    if options.ignore_eos and options.backend == "transformers":
        body["generation_config"] = json.dumps(
            {"min_new_tokens": request.max_tokens, "max_new_tokens": request.max_tokens,
             "do_sample": options.temperature > 0})
    elif options.ignore_eos:
        body["ignore_eos"] = True
    body.update(request.extra)
    return path, body


async def send(client: aiohttp.ClientSession, request: BenchRequest, options: ServerOptions,
               record: RequestRecord, on_token=None) -> None:
    """Stream one request, filling `record` as chunks arrive (a cancelled request keeps
    what it had). `on_token()` is called for each content chunk (progress display)."""
    path, body = request_body(request, options)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    began = time.perf_counter()
    try:
        async with client.post(options.base_url + path, json=body,
                               headers=headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                record.error = f"HTTP {response.status}: {text[:300]}"
                return
            async for line in response.content:  # one line at a time, b"\n" included
                if _on_line(line.decode(), record, time.perf_counter() - began) and on_token:
                    on_token()
        record.done_s = time.perf_counter() - began
        if not record.usage_reported:
            record.output_tokens = len(record.token_times_s)
        if not record.token_times_s and record.error is None:
            record.error = "the stream ended without any content"
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"


def _on_line(line: str, record: RequestRecord, now_s: float) -> bool:
    """Apply one SSE line to the record; True when it carried generated text."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return False
    chunk = json.loads(data)
    if chunk.get("error"):
        record.error = str(chunk["error"])[:300]
        return False
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        record.output_tokens = usage["completion_tokens"]
        record.prompt_tokens = usage.get("prompt_tokens")
        record.usage_reported = True
    if _has_text(chunk):
        record.token_times_s.append(now_s)
        return True
    return False


def _has_text(chunk: dict) -> bool:
    # The role-only first delta that chat servers send is no token: TTFT waits for text.
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or choice.get("text"):
            return True
    return False


async def discover_model(client: aiohttp.ClientSession, base_url: str,
                         api_key: str | None = None) -> str:
    """The first model the server lists (most serve exactly one; the base model first)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client.get(normalize_base_url(base_url) + "/v1/models",
                          headers=headers) as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
