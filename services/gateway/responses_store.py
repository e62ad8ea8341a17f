"""Responses kept for previous_response_id and GET /v1/responses/{id}: in this gateway's memory,
bounded in bytes (the oldest dropped first when full) and in time (each kept --responses-store-ttl
seconds). Several gateway replicas each keep their own: a client that continues a response must
reach the gateway that answered it (session affinity), else it gets a 404."""
from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvrelay.common.flags import add_flag


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--responses-store-bytes", type=int, default=64 << 20,
             help="memory for stored /v1/responses results (their JSON size), the oldest "
                  "dropped first when full; 0: none kept, and a request with store=true is a 400")
    add_flag(parser, "--responses-store-ttl", type=float, default=3600.0,
             help="seconds a stored /v1/responses result is kept (> 0)")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict  # the response object as the client got it
    # The conversation a continuation starts from: the messages this response continued, its
    # own input and its output, as the tokenizer renders them (no instructions: those are not
    # carried over, as in OpenAI's API).
    conversation: tuple[dict, ...]
    size: int
    expires_at: float


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic) -> None:
        if max_bytes < 0 or ttl_s <= 0:
            raise ValueError(f"--responses-store-bytes must be >= 0 and --responses-store-ttl "
                             f"> 0, got {max_bytes} and {ttl_s}")
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ResponseStore":
        return cls(args.responses_store_bytes, args.responses_store_ttl)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, response_id: str, body: dict, conversation: list[dict]) -> None:
        """Keep a finished response; one larger than the whole store is not kept."""
        size = len(json.dumps([body, conversation], ensure_ascii=False))
        if size > self.max_bytes:
            return
        self.delete(response_id)
        self._expire()
        while self.num_bytes + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[response_id] = StoredResponse(body, tuple(conversation), size,
                                                   self.clock() + self.ttl_s)
        self.num_bytes += size

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        if response_id not in self.entries:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        # Entries are in insertion order and share one TTL, so the expired ones lead.
        now = self.clock()
        while self.entries and next(iter(self.entries.values())).expires_at <= now:
            self._drop(next(iter(self.entries)))

    def _drop(self, response_id: str) -> None:
        self.num_bytes -= self.entries.pop(response_id).size
