"""The scheduler's request ids are the gateway's own, never the client's. Regression: a client's
x-request-id "dup-0", sent while a two-prompt request "dup" ran, named that request's first
prompt at the scheduler ("dup-0"): the second Submit was refused as a duplicate, and closing the
refused request aborted and dropped the first one's prompt, which then never finished (the
request hung; found while fuzzing request ids)."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway.core import GatewayCore
from kvrelay.gateway.errors import GatewayError
from kvrelay.gateway.messages import SchedulerStats
from kvrelay.gateway.upstream import Upstream


def test_client_ids_never_reach_the_scheduler_as_its_ids():
    async def scenario():
        upstream = Upstream("127.0.0.1:9", ["127.0.0.1:9"])  # nothing listens there
        group = upstream.groups[0]
        group.outputs_connected = True
        group.stats = SchedulerStats(ready=True)
        core = GatewayCore(upstream, "gateway-test")
        submitted: list[str] = []

        async def submit(generation):
            # as the scheduler refuses a Submit whose id it already holds
            if generation.client_request_id == "dup-0":
                raise GatewayError("invalid_request", "refused")
            submitted.extend(prompt.request_id for prompt in generation.prompts)

        group.submit = submit
        try:
            first = await core.generate("dup", [[1, 2], [3, 4]], SamplingParams())
            with pytest.raises(GatewayError, match="refused"):
                await core.generate("dup-0", [[5, 6]], SamplingParams())
            own = [state.request_id for state in first.states]
            # the refused request took nothing of the first one with it
            assert all(rid in core.router.requests for rid in own)
            assert not set(group.pending_aborts) & set(own)
            assert set(core.groups) == {"dup"}
            assert submitted == own and len(set(own)) == 2
            assert not any(rid.startswith("dup") or "/" in rid for rid in own)
        finally:
            await upstream.close()

    asyncio.run(scenario())


def test_grpc_request_ids_that_metadata_cannot_carry_are_refused_by_name():
    from kvrelay.gateway.grpc_api import _client_request_id
    assert _client_request_id("r-1 a", "gen") == "r-1 a"
    assert _client_request_id("", "gen").startswith("gen-")
    for bad in ("ü🚀", "a\nb", "x" * 257):
        with pytest.raises(GatewayError) as refused:
            _client_request_id(bad, "gen")
        assert refused.value.param == "request_id"


def test_metadata_carries_any_rest_request_id():
    from kvrelay.common.log import request_metadata
    assert request_metadata("r-1") == (("x-request-id", "r-1"),)
    assert request_metadata("ü") == (("x-request-id", "%C3%BC"),)
    assert request_metadata("") == ()
