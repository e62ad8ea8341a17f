"""Greedy float32 output with speculative decoding equals the output without it, token for
token, with both proposers, on prompts where drafts are accepted and where they are not; with
stop strings, max_tokens and EOS inside accepted runs, penalties, logprobs, n > 1 and
structured output."""
from __future__ import annotations

import json

import pytest

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.structured.spec import StructuredOutputs

COPY_PROMPT = ("Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, "
               "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya.")
CODE_PROMPT = ("Here is a function:\n\ndef add(a, b):\n    return a + b\n\n"
               "Rewrite it with the name plus instead of add, keeping everything else.")
FREE_PROMPT = "Tell me about the moon."
PROMPTS = [COPY_PROMPT, CODE_PROMPT, FREE_PROMPT]
METHODS = ["ngram", "suffix"]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="module", params=METHODS)
def speculative(request):
    llm = LLM(dtype="float32", num_kv_blocks=512, speculative_config={
        "method": request.param, "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5})
    return llm


def _stats(llm: LLM):
    return llm.engine.spec_decode_stats


def _both(plain, speculative, prompts, params):
    want = plain.chat([ask(p) for p in prompts], params, use_tqdm=False)
    got = speculative.chat([ask(p) for p in prompts], params, use_tqdm=False)
    return want, got


def _assert_same(want, got):
    for expected, actual in zip(want, got):
        for a, b in zip(expected.outputs, actual.outputs):
            assert b.token_ids == a.token_ids, (a.text, b.text)
            assert (b.text, b.finish_reason, b.stop_reason) == \
                (a.text, a.finish_reason, a.stop_reason)


def test_greedy_equals_plain_decoding_and_drafts_are_accepted(plain, speculative):
    before = _stats(speculative).num_accepted_tokens
    want, got = _both(plain, speculative, PROMPTS, SamplingParams(temperature=0, max_tokens=96))
    _assert_same(want, got)
    stats = _stats(speculative)
    assert stats.num_accepted_tokens > before  # the copying prompts accepted drafts
    assert stats.num_draft_tokens >= stats.num_accepted_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_a_prompt_without_repetition_still_matches(plain, speculative):
    want, got = _both(plain, speculative, ["Hi"], SamplingParams(temperature=0, max_tokens=24))
    _assert_same(want, got)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 33])
def test_max_tokens_cuts_inside_an_accepted_run(plain, speculative, max_tokens):
    want, got = _both(plain, speculative, [COPY_PROMPT],
                      SamplingParams(temperature=0, max_tokens=max_tokens))
    _assert_same(want, got)
    assert len(got[0].outputs[0].token_ids) == max_tokens


def test_stop_strings_and_eos_inside_an_accepted_run(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=96, stop=["kiwi"])
    want, got = _both(plain, speculative, [COPY_PROMPT], params)
    _assert_same(want, got)
    assert got[0].outputs[0].stop_reason == "kiwi"
    # EOS: short answers end on it; the stop token id variant ends on a chosen token
    want, got = _both(plain, speculative, ["Repeat after me: the cat sat on the mat."],
                      SamplingParams(temperature=0, max_tokens=64))
    _assert_same(want, got)
    assert got[0].outputs[0].finish_reason == "stop"
    comma = plain.get_tokenizer().encode(",")[0]
    params = SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[comma], min_tokens=4)
    want, got = _both(plain, speculative, [COPY_PROMPT], params)
    _assert_same(want, got)


def test_logprobs_are_those_of_the_emitted_tokens(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=3)
    want, got = _both(plain, speculative, [COPY_PROMPT], params)
    _assert_same(want, got)
    expected, actual = want[0].outputs[0].logprobs, got[0].outputs[0].logprobs
    assert len(actual) == len(got[0].outputs[0].token_ids)
    for a, b in zip(expected, actual):
        assert a.keys() == b.keys()
        for token_id in a:
            assert b[token_id].logprob == pytest.approx(a[token_id].logprob, abs=1e-4)
            assert b[token_id].rank == a[token_id].rank


def test_penalties_bad_words_and_n_apply_at_every_verified_position(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3,
                            frequency_penalty=0.2, n=2)
    want, got = _both(plain, speculative, [COPY_PROMPT], params)
    _assert_same(want, got)
    banana = plain.get_tokenizer().encode(" banana")
    params = SamplingParams(temperature=0, max_tokens=40, bad_words_token_ids=[banana])
    want, got = _both(plain, speculative, [COPY_PROMPT], params)
    _assert_same(want, got)


def test_structured_output_checks_drafts_against_the_grammar(plain, speculative):
    schema = {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string"}, "maxItems": 14}},
        "required": ["fruits"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=160,
                            structured_outputs=StructuredOutputs.json_schema(schema))
    want, got = _both(plain, speculative, [COPY_PROMPT + " Answer as JSON."], params)
    _assert_same(want, got)
    json.loads(got[0].outputs[0].text)


def test_a_request_can_opt_out(speculative):
    before = _stats(speculative).num_drafts
    speculative.chat([ask(COPY_PROMPT)], SamplingParams(temperature=0, max_tokens=32,
                                                        disable_speculation=True),
                     use_tqdm=False)
    assert _stats(speculative).num_drafts == before


def test_every_block_is_free_afterwards(speculative):
    scheduler = speculative.engine.scheduler
    assert not scheduler.requests and not scheduler.running
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_blocks
