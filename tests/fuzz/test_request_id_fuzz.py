"""Client-chosen request ids, concurrently: batches of REST completions (one or more prompts)
and gRPC Generate calls sent at once with ids drawn from a few that collide in every way ("r",
"r-0", "r/0", the same id twice). Each request ends (its own text, or a 400 for an id already
in flight), none hangs or fails, and the stack is fine afterwards. This is the fuzz that found
the scheduler ids built from client ids (tests/services/test_gateway_request_ids.py)."""
from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.fuzz.conftest import (REQUEST_TIMEOUT_S, SECONDS, TALLIES, assert_stack_fine,
                                 service_pids)

EXAMPLES = int(os.environ.get("KVRELAY_FUZZ_ID_EXAMPLES", "60"))
SEED = int(os.environ.get("KVRELAY_FUZZ_SEED", "0"))
TALLY = "request ids (concurrent)"
IDS = ["r", "r-0", "r-1", "r/0", "r/1", ""]

rest_call = st.fixed_dictionaries({
    "api": st.just("rest"), "id": st.sampled_from(IDS),
    "prompt": st.lists(st.sampled_from(["Once upon", "The sky", "Hi"]), min_size=1, max_size=3),
    "n": st.integers(1, 2), "max_tokens": st.integers(1, 12), "stream": st.booleans()})
grpc_call = st.fixed_dictionaries({
    "api": st.just("grpc"), "id": st.sampled_from(IDS), "prompt": st.just(["Hello"]),
    "n": st.integers(1, 2), "max_tokens": st.integers(1, 12), "stream": st.just(True)})


@pytest.fixture(scope="module")
def pids(fuzz_stack):
    return service_pids(fuzz_stack)


def send(stack, call: dict) -> str:
    """The request's outcome: 200 / OK, or a 400 / INVALID_ARGUMENT for an id in flight."""
    if call["api"] == "grpc":
        request = generation_pb2.GenerateRequest(
            request_id=call["id"], prompt=call["prompt"][0], params=common_pb2.SamplingParams(
                n=call["n"], max_tokens=call["max_tokens"], ignore_eos=True))
        with grpc.insecure_channel(stack.grpc_address) as channel:
            try:
                list(generation_pb2_grpc.GenerationStub(channel).Generate(
                    request, timeout=REQUEST_TIMEOUT_S))
                return "OK"
            except grpc.RpcError as exc:
                return exc.code().name
    headers = {"x-request-id": call["id"]} if call["id"] else {}
    body = {key: call[key] for key in ("prompt", "n", "max_tokens", "stream")}
    response = httpx.post(f"{stack.base_url}/completions", json={**body, "ignore_eos": True},
                          headers=headers, timeout=REQUEST_TIMEOUT_S, trust_env=False)
    if response.status_code == 200 and call["stream"]:
        assert '"error"' not in response.text, response.text
        assert response.text.endswith("data: [DONE]\n\n"), response.text
    return str(response.status_code)


def test_colliding_client_ids_at_once(fuzz_stack, pids):
    tally = TALLIES.setdefault(TALLY, Counter())
    started = time.monotonic()

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(batch=st.lists(st.one_of(rest_call, grpc_call), min_size=2, max_size=4))
    def each(batch):
        with ThreadPoolExecutor(len(batch)) as pool:
            try:
                outcomes = list(pool.map(lambda call: send(fuzz_stack, call), batch))
            except httpx.TimeoutException:
                tally["hang"] += 1
                raise AssertionError(f"a request hung: {batch}") from None
        tally.update(outcomes)
        assert set(outcomes) <= {"200", "OK", "400", "INVALID_ARGUMENT"}, (outcomes, batch)
        ids = [call["id"] for call in batch if call["id"]]
        if len(set(ids)) == len(ids):  # no id twice at once: nothing may be refused
            assert set(outcomes) <= {"200", "OK"}, (outcomes, batch)

    try:
        each()
    finally:
        SECONDS[TALLY] = time.monotonic() - started


def test_the_stack_is_fine_after_the_fuzz(fuzz_stack, pids):
    assert_stack_fine(fuzz_stack, pids)
