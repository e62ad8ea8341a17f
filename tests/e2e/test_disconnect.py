"""A client that goes away mid-stream: its request is aborted everywhere and every KV block it
held is free again on both workers within a second."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from kvrelay.client import KvrelayClient

ABORT_DEADLINE_S = 1.0


def all_blocks_free(stats) -> bool:
    return (stats.num_running == stats.num_waiting == stats.num_transferring == 0
            and all(w.num_free_blocks == w.num_blocks for w in stats.workers))


def describe(stats) -> str:
    workers = ", ".join(f"{w.worker_id}: {w.num_free_blocks}/{w.num_blocks} free, "
                        f"{w.num_running} running" for w in stats.workers)
    return (f"running {stats.num_running}, waiting {stats.num_waiting}, "
            f"transferring {stats.num_transferring}; {workers}")


def wait_until_all_free(pd_stack) -> None:
    closed_at = time.monotonic()
    while not all_blocks_free(stats := pd_stack.scheduler_stats()):
        assert time.monotonic() - closed_at < ABORT_DEADLINE_S, \
            f"still held {ABORT_DEADLINE_S}s after the disconnect: {describe(stats)}"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_every_block(pd_stack, model_id):
    before = pd_stack.scheduler_stats()
    assert all_blocks_free(before), f"blocks held before the test: {describe(before)}"
    assert len(before.workers) == 2
    body = {"model": model_id, "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with httpx.Client(timeout=60, trust_env=False) as http:
        with http.stream("POST", f"{pd_stack.base_url}/chat/completions", json=body) as response:
            assert response.status_code == 200
            # Keep the iterator alive: dropping a half-read one closes the connection already.
            lines = response.iter_lines()
            events = []
            while len(events) < 5 and (line := next(lines, None)) is not None:
                if line.startswith("data: "):
                    events.append(line[6:])
            assert len(events) == 5 and "[DONE]" not in events, f"the stream ended: {events}"
            assert not any("error" in json.loads(event) for event in events), events
            during = pd_stack.scheduler_stats()
            assert during.num_running == 1, describe(during)
            assert any(w.num_free_blocks < w.num_blocks for w in during.workers)
        # Leaving the block closes the response: the connection is gone.
    wait_until_all_free(pd_stack)


def test_grpc_client_leaving_its_stream_early_frees_every_block(pd_stack):
    async def read_a_few_chunks() -> int:
        async with KvrelayClient(pd_stack.grpc_address) as client:
            stream = client.generate("Once upon a time", max_tokens=2000, ignore_eos=True)
            num_chunks = 0
            async for _ in stream:
                num_chunks += 1
                if num_chunks == 5:
                    during = pd_stack.scheduler_stats()
                    assert during.num_running == 1, describe(during)
                    break
            await stream.aclose()  # cancels the call: the gateway must abort the request
            return num_chunks

    assert asyncio.run(read_a_few_chunks()) == 5
    wait_until_all_free(pd_stack)
