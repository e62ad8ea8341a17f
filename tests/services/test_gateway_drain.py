"""A draining gateway refuses new requests on every front end: the check lives in the core that
both the REST app and the public gRPC API call. A new request waits a bounded time for a ready
scheduler group, at its model check and at its submit."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway.core import GatewayCore
from kvrelay.gateway.errors import GatewayError
from kvrelay.gateway.messages import SchedulerStats
from kvrelay.gateway.upstream import Upstream


def test_generate_is_refused_once_the_core_drains():
    async def scenario():
        # nothing listens on these ports: a refused request must not even try to reach them
        upstream = Upstream("127.0.0.1:9", ["127.0.0.1:9"])
        core = GatewayCore(upstream, "gateway-test")
        try:
            await asyncio.wait_for(core.drain(), 1)  # nothing in flight: done at once
            with pytest.raises(GatewayError, match="shutting down") as caught:
                await core.generate("r", [[1, 2, 3]], SamplingParams())
            assert caught.value.http_status == 503
            assert not core.groups
        finally:
            await upstream.close()

    asyncio.run(scenario())


def test_a_new_request_waits_a_bounded_time_for_a_ready_scheduler_group():
    async def scenario():
        upstream = Upstream("127.0.0.1:9", ["127.0.0.1:9"])
        core = GatewayCore(upstream, "gateway-test", submit_wait_s=0.6)
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            with pytest.raises(GatewayError, match="no scheduler group is ready") as caught:
                await core.generate("r1", [[1, 2, 3]], SamplingParams())
            assert caught.value.http_status == 503 and loop.time() - started >= 0.55

            async def comes_back():  # the group turns ready while the request waits
                await asyncio.sleep(0.2)
                group = upstream.groups[0]
                group.outputs_connected = True
                group.stats = SchedulerStats(ready=True)

            started = loop.time()
            back = asyncio.create_task(comes_back())
            with pytest.raises(GatewayError, match="scheduler is unavailable"):
                # it waited, then submitted: nothing listens on the port, so Submit fails
                await core.generate("r2", [[1, 2, 3]], SamplingParams())
            await back
            assert loop.time() - started < 0.55
        finally:
            await upstream.close()

    asyncio.run(scenario())


def test_a_generation_waits_for_the_model_while_its_scheduler_group_restarts():
    """The model is known from a ready scheduler group. A generation that arrives while the only
    group is restarting waits for it, as its submit would, rather than a 503 at the model
    check (the kill series caught that: requests 30 ms before the group was ready again)."""
    from kvrelay.gateway.openai_serving import generation_model

    async def scenario():
        upstream = Upstream("127.0.0.1:9", ["127.0.0.1:9"])
        core = GatewayCore(upstream, "gateway-test", submit_wait_s=0.6)
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            with pytest.raises(GatewayError, match="no scheduler group is ready") as caught:
                await generation_model(core, None)
            assert caught.value.http_status == 503 and loop.time() - started >= 0.55

            async def comes_back():
                await asyncio.sleep(0.2)
                group = upstream.groups[0]
                group.outputs_connected = True
                group.stats = SchedulerStats(ready=True, model="smol")

            started = loop.time()
            back = asyncio.create_task(comes_back())
            assert await generation_model(core, "smol") == "smol"
            await back
            assert loop.time() - started < 0.55
            with pytest.raises(GatewayError, match="does not exist") as caught:  # ready: no wait
                await generation_model(core, "other")
            assert caught.value.http_status == 404  # model_not_found, as OpenAI answers
        finally:
            await upstream.close()

    asyncio.run(scenario())
