"""Speculative decoding through the PD stack (drafts proposed by the scheduler, verified on the
decode worker): greedy float32 outputs equal the offline engine's without speculation, token for
token, over gRPC and REST (streamed and not), with stop strings and logprobs; drafts are
accepted and counted in the metrics; every block is free afterwards."""
from __future__ import annotations

import json

import pytest

from kvrelay.engine import SamplingParams
from tests.e2e.conftest import chat_prompt_ids, openai_client
from tests.e2e.grpc_api import generate, token_ids_request
from tests.e2e.stack import metric_values, start_stack, stop_and_check
from tests.e2e.test_disconnect import wait_until_all_free

COPY = ("Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango, nectarine, orange, papaya.")
CODE = ("Here is a function:\n\ndef add(a, b):\n    return a + b\n\n"
        "Rewrite it with the name plus instead of add, keeping everything else.")
FREE = "Tell me about the moon."
MAX_TOKENS = 64


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def spec_stack(request, tmp_path_factory):
    config = json.dumps({"method": request.param, "num_speculative_tokens": 4})
    stack = start_stack("pd", tmp_path_factory.mktemp(f"spec-{request.param}"),
                        "--speculative-config", config)
    yield stack
    stop_and_check(stack)


_REFERENCES: dict[str, tuple] = {}  # both proposers' stacks are checked against the same runs


def _offline(offline_llm, tokenizer, prompts, **params):
    key = repr((prompts, sorted(params.items())))
    if key not in _REFERENCES:
        ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        outputs = offline_llm.generate(
            [{"prompt_token_ids": i} for i in ids],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params), use_tqdm=False)
        _REFERENCES[key] = ids, [output.outputs[0] for output in outputs]
    return _REFERENCES[key]


def _accepted(stack) -> float:
    url = stack.service("scheduler")["metrics_url"]
    return sum(metric_values(url, "kvrelay:spec_decode_num_accepted_tokens_total").values())


def test_grpc_greedy_equals_plain_decoding_and_drafts_are_accepted(spec_stack, offline_llm,
                                                                   tokenizer):
    ids, want = _offline(offline_llm, tokenizer, [COPY, CODE, FREE])
    for prompt_ids, expected in zip(ids, want):
        got = generate(spec_stack.grpc_address, token_ids_request(
            prompt_ids, temperature=0.0, max_tokens=MAX_TOKENS))
        assert got.token_ids[0] == expected.token_ids
        assert got.text[0] == expected.text
        assert got.usage.completion_tokens == len(expected.token_ids)
    assert _accepted(spec_stack) > 0
    url = spec_stack.service("scheduler")["metrics_url"]
    per_position = metric_values(url, "kvrelay:spec_decode_num_accepted_tokens_per_pos_total")
    assert sum(per_position.values()) == _accepted(spec_stack)


def test_rest_streams_every_token_once_with_stop_strings_and_logprobs(spec_stack, offline_llm,
                                                                      tokenizer):
    client = openai_client(spec_stack)
    model = client.models.list().data[0].id
    _, [expected] = _offline(offline_llm, tokenizer, [COPY], stop=["kiwi"], logprobs=0)
    args = dict(model=model, messages=[{"role": "user", "content": COPY}], temperature=0,
                max_tokens=MAX_TOKENS, stop=["kiwi"])
    full = client.chat.completions.create(logprobs=True, **args)
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].finish_reason == "stop"
    # one logprob per token up to the one that completed the stop string, none past it
    assert len(full.choices[0].logprobs.content) == len(expected.token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids)
    streamed = list(client.chat.completions.create(stream=True, **args))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == expected.text


def test_a_request_opts_out(spec_stack, offline_llm, tokenizer):
    before = _accepted(spec_stack)
    ids, [expected] = _offline(offline_llm, tokenizer, [COPY])
    got = generate(spec_stack.grpc_address, token_ids_request(
        ids[0], temperature=0.0, max_tokens=MAX_TOKENS, disable_speculation=True))
    assert got.token_ids[0] == expected.token_ids
    assert _accepted(spec_stack) == before


def test_every_block_is_free_afterwards(spec_stack):
    wait_until_all_free(spec_stack)
