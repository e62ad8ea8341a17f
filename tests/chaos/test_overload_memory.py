"""Memory stays flat under 10x overload: a stack limited to 32 waiting requests gets waves of
ten times that at once. What does not fit is refused at once (503, Retry-After), nothing
below the limit is refused, and the front services' and scheduler's resident memory does not
grow from wave to wave. `make chaos` runs it."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.chaos.load import wait_healed
from tests.e2e.stack import start_stack, stop_and_check

LIMIT = 32
WAVE = 10 * LIMIT
NUM_WAVES = 6
GROWTH_BUDGET_MB = 40  # allocator noise; a leak of one byte per refused request is ~2 KB


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack("pd", tmp_path_factory.mktemp("overload-memory"),
                          "--max-queued-requests", str(LIMIT))
    yield running
    stop_and_check(running)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def _wave(base_url: str, model: str) -> list[int]:
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}]}
    limits = httpx.Limits(max_connections=WAVE, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as http:
        replies = await asyncio.gather(*(http.post(f"{base_url}/chat/completions", json=body)
                                         for _ in range(WAVE)))
    for reply in replies:
        if reply.status_code == 503:
            assert reply.headers["Retry-After"] == "1" and "overloaded" in reply.text
    return [reply.status_code for reply in replies]


def test_ten_times_the_limit_keeps_memory_flat(stack):
    model = httpx.get(f"{stack.base_url}/models", trust_env=False).json()["data"][0]["id"]
    pids = {name: stack.service(name)["pid"] for name in ("gateway", "scheduler", "tokenizer")}
    after_wave = []
    for wave in range(NUM_WAVES):
        statuses = asyncio.run(_wave(stack.base_url, model))
        assert set(statuses) <= {200, 503}, sorted(set(statuses))
        assert statuses.count(200) >= LIMIT  # what fits is served, never refused
        assert statuses.count(503) > 0  # and the rest is not queued without bound
        wait_healed(stack, None)
        after_wave.append({name: _rss_mb(pid) for name, pid in pids.items()})
        print(f"wave {wave}: {statuses.count(200)} served, {statuses.count(503)} refused; RSS MB "
              + ", ".join(f"{name} {mb:.1f}" for name, mb in after_wave[-1].items()))
    # The first wave grows the pools (allocator arenas, gRPC buffers); later ones must not.
    for name in pids:
        growth = after_wave[-1][name] - after_wave[1][name]
        assert growth < GROWTH_BUDGET_MB, (name, [round(w[name], 1) for w in after_wave])
