"""hypothesis-generated calls to the public gRPC API (kvrelay.v1.Generation) on a real stack:
GenerateRequests with any mix of inputs and sampling parameters (out-of-range numbers, NaN,
control characters, bad grammars, token ids past the vocabulary), some left mid-stream, plus
Tokenize, Abort, Embed and raw bytes that are not a valid message. No call ends INTERNAL, UNKNOWN or
UNAVAILABLE, none hangs (each has a deadline, so a hang is DEADLINE_EXCEEDED), no stream carries
a choice that finished with an error; the stack is fine afterwards."""
from __future__ import annotations

import functools
import os
import time
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.fuzz.conftest import (REQUEST_TIMEOUT_S, SECONDS, TALLIES, assert_stack_fine,
                                 service_pids)

EXAMPLES = int(os.environ.get("KVRELAY_FUZZ_GRPC_EXAMPLES", "600"))
SEED = int(os.environ.get("KVRELAY_FUZZ_SEED", "0"))
# What a correct gateway may answer to anything: the caller's fault, or too much at once.
FINE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.CANCELLED}  # CANCELLED: the fuzzer left the stream itself
TALLY = "grpc (hypothesis)"
VOCAB = 49152  # SmolLM2's; ids around it and far past it are drawn too

# ---- strategies ----------------------------------------------------------------------------------
UINT32 = st.integers(0, 2**32 - 1)
small = st.integers(0, 4)
texts = st.one_of(st.text(max_size=24), st.sampled_from(
    ["Hi", "Once upon a time", "\x00", "a\x1bb", "tab\there", "{", "(", "\\", "ü🚀", " "]))
token_ids = st.one_of(st.integers(0, VOCAB + 8), UINT32)
floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]))


def maybe(strategy):
    return st.one_of(st.none(), strategy)


structured = st.one_of(
    st.builds(common_pb2.StructuredOutputs, json=st.one_of(texts, st.sampled_from(
        ['{"type": "object"}', '{"type": "string", "maxLength": 3}', '{"enum": [1, 2]}',
         '{"type": "array", "items": {"$ref": "#/nope"}}', "[]", "{}"]))),
    st.builds(common_pb2.StructuredOutputs, json_object=st.booleans()),
    st.builds(common_pb2.StructuredOutputs, regex=st.one_of(texts, st.sampled_from(
        ["a+", "[0-9]{2}", "(a|b)*c", "(", "a{99999}", "\\p{L}+"]))),
    st.builds(common_pb2.StructuredOutputs, choice=st.builds(
        common_pb2.ChoiceList, choices=st.lists(texts, max_size=3))),
    st.builds(common_pb2.StructuredOutputs, grammar=st.one_of(texts, st.sampled_from(
        ['start: "a"', 'root ::= "yes" | "no"', "start: x", "root ::="]))),
)
params = st.builds(
    common_pb2.SamplingParams,
    n=maybe(st.one_of(small, UINT32)), temperature=maybe(floats), top_p=maybe(floats),
    top_k=maybe(st.integers(-2**31, 2**31 - 1)), min_p=maybe(floats),
    seed=maybe(st.integers(-2**63, 2**63 - 1)),
    max_tokens=maybe(st.one_of(st.integers(0, 12), UINT32)),
    min_tokens=st.one_of(small, UINT32), stop_token_ids=st.lists(token_ids, max_size=3),
    stop=st.lists(texts, max_size=3), ignore_eos=st.booleans(), presence_penalty=floats,
    frequency_penalty=floats, repetition_penalty=maybe(floats),
    logprobs=maybe(st.one_of(small, UINT32)), skip_special_tokens=maybe(st.booleans()),
    structured_outputs=maybe(structured),
    logit_bias=st.dictionaries(token_ids, floats, max_size=3),
    allowed_token_ids=maybe(st.builds(common_pb2.TokenIdList,
                                      ids=st.lists(token_ids, max_size=4))),
    bad_words_token_ids=st.lists(st.builds(common_pb2.TokenIdList,
                                           ids=st.lists(token_ids, max_size=3)), max_size=2),
    disable_speculation=st.booleans(),
    prompt_logprobs=maybe(st.one_of(small, UINT32)),
    pooling=st.one_of(st.just(""), st.sampled_from(["last", "mean"]), texts))
messages = st.builds(generation_pb2.ChatMessages, messages=st.lists(st.builds(
    common_pb2.ChatMessage, role=st.one_of(st.sampled_from(["user", "assistant", "system"]),
                                           texts),
    content=texts), max_size=4), add_generation_prompt=st.booleans())
inputs = st.one_of(
    st.fixed_dictionaries({"prompt": texts}),
    st.fixed_dictionaries({"prompt_token_ids": st.builds(
        generation_pb2.TokenIds, ids=st.lists(token_ids, max_size=70))}),
    st.fixed_dictionaries({"chat": messages}),
    st.just({}))
generate_requests = st.builds(
    lambda source, **fields: generation_pb2.GenerateRequest(**source, **fields),
    inputs, params=params, request_id=st.one_of(st.just(""), texts),
    model=st.one_of(st.just(""), st.just(None), texts), priority=st.integers(-2**31, 2**31 - 1))
embed_requests = st.builds(
    generation_pb2.EmbedRequest, request_id=st.one_of(st.just(""), texts),
    model=st.one_of(st.just(""), texts), texts=st.lists(texts, max_size=3),
    token_ids=st.lists(st.builds(generation_pb2.TokenIds, ids=st.lists(token_ids, max_size=40)),
                       max_size=3), priority=st.integers(-2**31, 2**31 - 1))
tokenize_requests = st.builds(
    lambda source, **fields: generation_pb2.TokenizeRequest(**source, **fields),
    st.one_of(st.fixed_dictionaries({"prompt": texts}),
              st.fixed_dictionaries({"chat": messages}), st.just({})),
    model=st.one_of(st.just(""), texts), add_special_tokens=st.booleans())


def fuzz_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.generate, Phase.shrink])


# ---- the calls -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pids(fuzz_stack):
    return service_pids(fuzz_stack)


@pytest.fixture(scope="module")
def channel(fuzz_stack, pids):
    with grpc.insecure_channel(fuzz_stack.grpc_address) as opened:
        yield opened


def record(code: grpc.StatusCode, details: str, what) -> None:
    TALLIES.setdefault(TALLY, Counter())[code.name] += 1
    assert code in FINE, (code.name, details, what)


def timed(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        started = time.monotonic()
        try:
            test(*args, **kwargs)
        finally:
            SECONDS[TALLY] = SECONDS.get(TALLY, 0) + time.monotonic() - started
    return run


@timed
def test_generate(channel):
    stub = generation_pb2_grpc.GenerationStub(channel)

    @seed(SEED)
    @fuzz_settings(EXAMPLES)
    @given(request=generate_requests, leave_after=st.one_of(st.none(), st.integers(1, 2)))
    def each(request, leave_after):
        call = stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        code, details = grpc.StatusCode.OK, ""
        try:
            for number, response in enumerate(call, 1):
                for choice in response.choices:
                    assert choice.finish_reason != common_pb2.FINISH_REASON_ERROR, \
                        (response, request)
                if number == leave_after:
                    call.cancel()  # the client leaves mid-stream: the request is aborted
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        record(code, details, request)

    each()


@timed
def test_tokenize_abort_and_list_models(channel):
    stub = generation_pb2_grpc.GenerationStub(channel)

    @seed(SEED)
    @fuzz_settings(EXAMPLES // 4)
    @given(request=tokenize_requests, abort_id=texts)
    def each(request, abort_id):
        for method, message in ((stub.Tokenize, request),
                                (stub.Abort, generation_pb2.AbortRequest(request_id=abort_id)),
                                (stub.ListModels, generation_pb2.ListModelsRequest())):
            try:
                method(message, timeout=REQUEST_TIMEOUT_S)
                record(grpc.StatusCode.OK, "", message)
            except grpc.RpcError as exc:
                record(exc.code(), exc.details(), message)

    each()


@timed
def test_embed(channel):
    stub = generation_pb2_grpc.GenerationStub(channel)

    @seed(SEED)
    @fuzz_settings(EXAMPLES // 4)
    @given(request=embed_requests)
    def each(request):
        try:
            reply = stub.Embed(request, timeout=REQUEST_TIMEOUT_S)
            assert len(reply.embeddings) == len(request.texts) + len(request.token_ids)
            record(grpc.StatusCode.OK, "", request)
        except grpc.RpcError as exc:
            record(exc.code(), exc.details(), request)

    each()


@timed
def test_bytes_that_are_not_a_valid_message(channel):
    methods = {"Generate": channel.unary_stream, "Tokenize": channel.unary_unary,
               "Abort": channel.unary_unary, "ListModels": channel.unary_unary,
               "Embed": channel.unary_unary}
    calls = {name: make(f"/kvrelay.v1.Generation/{name}") for name, make in methods.items()}

    @seed(SEED)
    @fuzz_settings(EXAMPLES // 4)
    @given(name=st.sampled_from(sorted(calls)), payload=st.one_of(
        st.binary(max_size=64),
        # a valid message with some bytes broken (bad UTF-8 in a string, a cut length)
        st.tuples(generate_requests, st.integers(0, 200), st.integers(0, 255)).map(
            lambda drawn: _corrupt(drawn[0].SerializeToString(), drawn[1], drawn[2]))))
    def each(name, payload):
        try:
            result = calls[name](payload, timeout=REQUEST_TIMEOUT_S)
            if name == "Generate":
                list(result)
            record(grpc.StatusCode.OK, "", (name, payload))
        except grpc.RpcError as exc:
            record(exc.code(), exc.details(), (name, payload))

    each()


def _corrupt(data: bytes, position: int, value: int) -> bytes:
    if not data:
        return bytes([value])
    position %= len(data)
    return data[:position] + bytes([value]) + data[position + 1:]


def test_the_stack_is_fine_after_the_fuzz(fuzz_stack, pids):
    assert_stack_fine(fuzz_stack, pids)
