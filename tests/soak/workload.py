"""The soak's mixed traffic, one kind of request per function. Each returns what went wrong, or
None; a reply it did not expect is returned, not raised (the soak counts both that and any
transport error).

Kinds: greedy streams checked against their undisturbed text; seeded sampled completions;
`n=2`; JSON held to a schema; a prompt sharing a long prefix with the others (prefix cache
hits); a client that drops its stream part-way; a bad request that must get its 400."""
from __future__ import annotations

import json
import random

import httpx

from tests.structured_schemas import SCHEMAS, validate

SHARED_PREFIX = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(60))


def chat(model: str, content: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


class Workload:
    def __init__(self, http: httpx.Client, base_url: str, model: str) -> None:
        self.http, self.base_url, self.model = http, base_url, model
        self.greedy = [chat(model, f"Tell me about place number {i}.", max_tokens=48,
                            temperature=0, ignore_eos=True) for i in range(8)]
        self.expected = [self._text(body) for body in self.greedy]

    def _text(self, body: dict) -> str:
        reply = self.http.post(f"{self.base_url}/chat/completions", json=body)
        reply.raise_for_status()
        return reply.json()["choices"][0]["message"]["content"]

    def kinds(self) -> list:
        return [self.greedy_stream, self.seeded_completion, self.two_choices, self.json_schema,
                self.shared_prefix, self.dropped_stream, self.bad_request]

    def greedy_stream(self, rng: random.Random) -> str | None:
        index = rng.randrange(len(self.greedy))
        pieces = []
        with self.http.stream("POST", f"{self.base_url}/chat/completions",
                              json={**self.greedy[index], "stream": True}) as response:
            if response.status_code != 200:
                return f"stream: HTTP {response.status_code}"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"stream: error event {event['error'].get('message')}"
                pieces.append(event["choices"][0]["delta"].get("content") or "")
        return None if "".join(pieces) == self.expected[index] else "stream: wrong text"

    def seeded_completion(self, rng: random.Random) -> str | None:
        seed = rng.randrange(16)
        reply = self.http.post(f"{self.base_url}/completions", json={
            "model": self.model, "prompt": f"Once upon a time, {seed}", "max_tokens": 24,
            "temperature": 0.9, "top_p": 0.95, "seed": seed})
        if reply.status_code != 200:
            return f"seeded: HTTP {reply.status_code}"
        usage = reply.json()["usage"]
        return None if 0 < usage["completion_tokens"] <= 24 else f"seeded: usage {usage}"

    def two_choices(self, rng: random.Random) -> str | None:
        reply = self.http.post(f"{self.base_url}/chat/completions", json=chat(
            self.model, "Name a fruit.", n=2, max_tokens=16, temperature=1.0,
            seed=rng.randrange(1000)))
        if reply.status_code != 200:
            return f"n=2: HTTP {reply.status_code}"
        return None if len(reply.json()["choices"]) == 2 else "n=2: not two choices"

    def json_schema(self, rng: random.Random) -> str | None:
        title, schema = SCHEMAS[rng.randrange(len(SCHEMAS))]
        reply = self.http.post(f"{self.base_url}/chat/completions", json=chat(
            self.model, f"Give an example of {title} as JSON.", max_tokens=160, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema, "strict": True}}))
        if reply.status_code != 200:
            return f"json: HTTP {reply.status_code}"
        choice = reply.json()["choices"][0]
        if choice["finish_reason"] != "stop":
            return None  # cut by max_tokens: valid so far, not a whole document
        try:
            validate(json.loads(choice["message"]["content"]), schema)
        except Exception as exc:  # noqa: BLE001
            return f"json: invalid output ({type(exc).__name__})"
        return None

    def shared_prefix(self, rng: random.Random) -> str | None:
        reply = self.http.post(f"{self.base_url}/chat/completions", json={
            "model": self.model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SHARED_PREFIX},
                         {"role": "user", "content": f"Question {rng.randrange(100)}?"}]})
        return None if reply.status_code == 200 else f"prefix: HTTP {reply.status_code}"

    def dropped_stream(self, rng: random.Random) -> str | None:
        cut_after = rng.randint(0, 5)
        with self.http.stream("POST", f"{self.base_url}/chat/completions", json=chat(
                self.model, "Write a long letter.", max_tokens=200, stream=True)) as response:
            if response.status_code != 200:
                return f"drop: HTTP {response.status_code}"
            for seen, _ in enumerate(response.iter_lines()):
                if seen >= cut_after:
                    return None  # leaving the block drops the connection

    def bad_request(self, rng: random.Random) -> str | None:
        body = rng.choice([chat(self.model, "hi", max_tokens=-1),
                           chat(self.model, "hi", temperature="hot"),
                           chat(self.model, "hi", n=10 ** 6),
                           {"model": self.model, "messages": []}])
        reply = self.http.post(f"{self.base_url}/chat/completions", json=body)
        return None if reply.status_code == 400 else f"bad: HTTP {reply.status_code}"
