"""The standard workloads as lists of timed requests: what to send, and when.

Every workload is a pure function of its seed (and rate), so two runs, or two servers, see the
same prompts arriving at the same offsets. `arrival_s` counts from the start of the run.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvrelay.bench.grounded import grounded
from kvrelay.bench.prompts import chat64, shared_prefix, user_message

DEFAULT_MAX_TOKENS = 128
WORKLOADS = ("chat-64", "chat-64-json", "grounded", "poisson", "shared-prefix", "long+short",
             "jsonl")
# chat-64-json: chat-64 with every request's output held to this schema (structured output's
# cost at a full batch). The answer string is unbounded, so a request still runs to max_tokens
# unless the model closes the object first.
JSON_SYSTEM_PROMPT = "You are a helpful assistant. Reply with one JSON object: a title, keywords and the answer."
CHAT_JSON_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 60},
                   "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                "maxItems": 5},
                   "answer": {"type": "string", "minLength": 2000}},
    "required": ["title", "keywords", "answer"], "additionalProperties": False}
LONG_SHORT_DEFAULT_RATE = 4.0  # short requests per second; the long ones arrive among them


@dataclass(slots=True)
class BenchRequest:
    """One request: a chat (`messages`) or a plain completion (`prompt`)."""
    messages: list[dict] | None = None
    prompt: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    arrival_s: float = 0.0
    tag: str = ""  # "long" / "short" in long+short: their latencies are reported apart
    extra: dict = field(default_factory=dict)  # other fields of a JSONL line, sent as they are

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a request has either messages or a prompt")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


MAX_POISSON_REQUESTS = 10_000  # a sweep point of hours at low rates is a mistake


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets of a Poisson process at `rate` per second: exponential gaps. The first
    request goes at 0 so that a run never starts with idle time. Infinite rate: all at once."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate)
        arrivals.append(now)
    return arrivals


def chat_requests(conversations: list[list[dict]], max_tokens: int = DEFAULT_MAX_TOKENS,
                  arrivals: list[float] | None = None) -> list[BenchRequest]:
    arrivals = arrivals or [0.0] * len(conversations)
    return [BenchRequest(messages=messages, max_tokens=max_tokens, arrival_s=at)
            for messages, at in zip(conversations, arrivals)]


def long_short(seed: int = 0, rate: float = LONG_SHORT_DEFAULT_RATE, num_short: int = 32,
               num_long: int = 4, long_tokens: int = 3000, include_long: bool = True,
               max_tokens: int = DEFAULT_MAX_TOKENS) -> list[BenchRequest]:
    """Short chat requests arriving as a Poisson process, with `num_long` ~3,000-token prompts
    spread evenly among them (each halfway between two short arrivals). Without the long ones
    the short requests are the same, at the same times: the two runs compare ITL directly."""
    shorts = chat_requests(chat64(seed, num_short), max_tokens,
                           poisson_arrivals(num_short, rate, seed))
    for request in shorts:
        request.tag = "short"
    if not include_long:
        return shorts
    rng = random.Random(seed + 1_000_003)  # its own stream: the short prompts stay the same
    longs = []
    for k in range(num_long):
        after = min(num_short - 2, (num_short * (2 * k + 1)) // (2 * num_long))
        arrival = (shorts[after].arrival_s + shorts[after + 1].arrival_s) / 2
        longs.append(BenchRequest(messages=[{"role": "user",
                                             "content": user_message(rng, long_tokens)}],
                                  max_tokens=max_tokens, arrival_s=arrival, tag="long"))
    return sorted(shorts + longs, key=lambda r: r.arrival_s)


def load_jsonl(path: str | Path, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[BenchRequest]:
    """One request a line: {"messages": [...]} or {"prompt": "..."}, optional "max_tokens";
    any other field is passed to the server as it is. Blank lines are skipped."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(_jsonl_request(json.loads(line), max_tokens))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def _jsonl_request(item, max_tokens: int) -> BenchRequest:
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    item = dict(item)
    messages, prompt = item.pop("messages", None), item.pop("prompt", None)
    if messages is not None and not (isinstance(messages, list) and messages
                                     and all(isinstance(m, dict) for m in messages)):
        raise ValueError('"messages" must be a non-empty list of objects')
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError('"prompt" must be a string')
    limit = item.pop("max_tokens", max_tokens)
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise ValueError('"max_tokens" must be an integer')
    return BenchRequest(messages=messages, prompt=prompt, max_tokens=limit, extra=item)


def build(name: str, seed: int = 0, rate: float | None = None, jsonl: str | None = None,
          max_tokens: int | None = None, include_long: bool = True,
          num_requests: int | None = None) -> list[BenchRequest]:
    """The named workload. `rate` (requests/s) makes the arrivals a Poisson process; without it
    every request arrives at once, except long+short, whose short requests always trickle in.
    `num_requests` (poisson only) draws that many of chat-64's kind of prompt instead of 64: a
    sweep whose load outlasts the first minute measures sustained capacity, where 64 requests at
    a high rate are one burst that any server absorbs."""
    if num_requests is not None and name != "poisson":
        raise ValueError("--num-requests applies to the poisson workload only")
    if num_requests is not None and not 1 <= num_requests <= MAX_POISSON_REQUESTS:
        raise ValueError(f"--num-requests must be in [1, {MAX_POISSON_REQUESTS}], got {num_requests}")
    limit = max_tokens or DEFAULT_MAX_TOKENS
    if name == "chat-64":
        requests = chat_requests(chat64(seed), limit)
    elif name == "chat-64-json":
        # chat-64's prompts behind a system message of their own: as long as with the default
        # system prompt, but no block in common, so a run after chat-64 on the same server
        # gets no prefix-cache hits.
        conversations = [[{"role": "system", "content": JSON_SYSTEM_PROMPT}, *conversation]
                         for conversation in chat64(seed)]
        requests = chat_requests(conversations, limit)
        for request in requests:
            request.extra = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": CHAT_JSON_SCHEMA}}}
    elif name == "grounded":
        # passages to copy or quote (grounded.py): where speculative decoding pays
        requests = chat_requests(grounded(seed), limit)
    elif name == "poisson":
        if rate is None:
            raise ValueError("the poisson workload needs --rate (or --rates)")
        requests = chat_requests(chat64(seed, num_requests or 64), limit)
    elif name == "shared-prefix":
        requests = chat_requests(shared_prefix(seed), limit)
    elif name == "long+short":
        return long_short(seed, rate or LONG_SHORT_DEFAULT_RATE, include_long=include_long,
                          max_tokens=limit)
    elif name == "jsonl":
        if not jsonl:
            raise ValueError("the jsonl workload needs --jsonl FILE")
        requests = load_jsonl(jsonl, limit)
        if max_tokens:  # the flag wins over each line's own limit
            requests = [replace(r, max_tokens=max_tokens) for r in requests]
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if rate is not None:
        for request, at in zip(requests, poisson_arrivals(len(requests), rate, seed)):
            request.arrival_s = at
    return requests
