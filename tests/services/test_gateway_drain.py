"""A draining gateway refuses new requests on every front end: the check lives in the core that
both the REST app and the public gRPC API call."""
from __future__ import annotations

import asyncio

import pytest

from services.engine.sampling_params import SamplingParams
from services.gateway.core import GatewayCore
from services.gateway.errors import GatewayError
from services.gateway.upstream import Upstream


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
