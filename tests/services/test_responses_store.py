"""The gateway's store of /v1/responses results: bounded in bytes (oldest dropped first; one too
large for the whole store never kept) and in time (gone after the TTL), with delete."""
from __future__ import annotations

import json

import pytest

from kvrelay.gateway.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(text: str) -> tuple[dict, list[dict]]:
    return {"id": text, "output": text}, [{"role": "user", "content": text}]


def size(text: str) -> int:
    return len(json.dumps(list(entry(text)), ensure_ascii=False))


def test_the_oldest_go_first_when_full():
    store = ResponseStore(max_bytes=3 * size("a" * 10), ttl_s=60)
    for name in "abcd":
        store.put(name, *entry(name * 10))
    assert store.get("a") is None and all(store.get(name) for name in "bcd")
    assert store.num_bytes == 3 * size("a" * 10)
    assert store.get("b").conversation == ({"role": "user", "content": "b" * 10},)


def test_too_large_is_not_kept_and_hurts_nothing():
    store = ResponseStore(max_bytes=size("a" * 10), ttl_s=60)
    store.put("a", *entry("a" * 10))
    store.put("big", *entry("b" * 11))
    assert store.get("big") is None and store.get("a") is not None


def test_entries_expire_and_can_be_deleted():
    clock = Clock()
    store = ResponseStore(max_bytes=1 << 20, ttl_s=10, clock=clock)
    store.put("a", *entry("a"))
    clock.now = 5
    store.put("b", *entry("b"))
    clock.now = 10
    assert store.get("a") is None and store.get("b") is not None
    assert store.delete("b") and not store.delete("b")
    assert store.num_bytes == 0 and not store.entries


def test_disabled_and_bad_settings():
    assert not ResponseStore(0, 60).enabled
    with pytest.raises(ValueError, match="responses-store"):
        ResponseStore(-1, 60)
    with pytest.raises(ValueError, match="responses-store"):
        ResponseStore(10, 0)
