"""schemathesis against the gateway's /openapi.json on a real stack: for every operation, requests
that fit the documented schema and requests that break it. Every answer is below 500, every
error is an OpenAI error body, no streamed answer carries an error event, no request hangs; the
stack is fine afterwards (conftest.assert_stack_fine)."""
from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.fuzz.conftest import (REQUEST_TIMEOUT_S, SECONDS, TALLIES, assert_stack_fine,
                                 service_pids)

# Every route the gateway serves on its REST port, as /openapi.json must document it.
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("POST", "/v1/embeddings"),
              ("DELETE", "/v1/responses/{response_id}"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/version")]
BODIES = {"/v1/chat/completions": "ChatCompletionRequest",
          "/v1/completions": "CompletionRequest", "/v1/responses": "ResponsesRequest",
          "/v1/embeddings": "EmbeddingRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
# Examples per (operation, mode); the GET routes take no input, so a few do.
EXAMPLES = int(os.environ.get("KVRELAY_FUZZ_EXAMPLES", "150"))
GET_EXAMPLES = 5
# Requests that fit the schema and ones that break it for the bodies; the GET routes have no
# input to break.
CASES = [(method, path, mode) for method, path in OPERATIONS
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if method == "POST" or mode == GenerationMode.POSITIVE]
SEED = int(os.environ.get("KVRELAY_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def api_schema(fuzz_stack):
    return schemathesis.openapi.from_url(f"{fuzz_stack.rest_url}/openapi.json")


@pytest.fixture(scope="module")
def pids(fuzz_stack):
    return service_pids(fuzz_stack)


def test_openapi_documents_every_route_and_body(api_schema):
    raw = api_schema.raw_schema
    documented = {(method.upper(), path) for path, item in raw["paths"].items()
                  for method in item}
    assert documented == set(OPERATIONS)
    for path, name in BODIES.items():
        body = raw["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"] == \
            f"#/components/schemas/{name}"


@pytest.mark.parametrize("method, path, mode", CASES, ids=lambda value: str(value))
def test_no_server_error_no_hang(fuzz_stack, api_schema, pids, method, path, mode):
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:
        strategy = st.tuples(strategy, st.booleans()).map(served_model_mostly)
    tally = TALLIES.setdefault("openapi (schemathesis)", Counter())
    session = requests.Session()
    session.trust_env = False
    started = time.monotonic()

    @seed(SEED)
    @settings(max_examples=EXAMPLES if method == "POST" else GET_EXAMPLES, deadline=None,
              database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink])
    @given(case=strategy)
    def each(case):
        try:
            response = case.call(base_url=fuzz_stack.rest_url, session=session,
                                 timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout:
            tally["hang"] += 1
            raise AssertionError(f"no answer in {REQUEST_TIMEOUT_S} s: {case.as_curl_command()}")
        tally[response.status_code] += 1
        check_response(response, case)

    try:
        each()
    finally:
        session.close()
        SECONDS["openapi (schemathesis)"] = SECONDS.get("openapi (schemathesis)", 0) + \
            time.monotonic() - started


def served_model_mostly(drawn):
    """A generated `model` is almost never the served one, which ends the request at once: half
    the valid-looking bodies leave it out, so that they reach the tokenizer and the scheduler."""
    case, keep_model = drawn
    if not keep_model and isinstance(case.body, dict):
        case.body.pop("model", None)
    return case


def check_response(response, case) -> None:
    where = case.as_curl_command()
    assert response.status_code < 500, (response.status_code, response.text[:500], where)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (error, where)
        assert isinstance(error["message"], str) and error["message"], (error, where)
    elif "text/event-stream" in str(response.headers.get("content-type")):
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), (line, where)


def test_the_stack_is_fine_after_the_fuzz(fuzz_stack, pids):
    assert_stack_fine(fuzz_stack, pids)
