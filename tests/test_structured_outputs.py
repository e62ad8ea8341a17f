"""Structured output in the offline engine: JSON schemas, choices, regexes, grammars, logit_bias
and allowed_token_ids, against the real model (float32), and their failure paths."""
from __future__ import annotations

import json
import re

import pytest

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.structured.backend import GrammarError
from kvrelay.engine.structured.spec import StructuredOutputs
from tests.structured_schemas import SCHEMAS, validate


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=512)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def constrained(spec: StructuredOutputs, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 200, **kwargs},
                          structured_outputs=spec)


def test_every_schema_of_the_corpus_gives_valid_json(llm):
    assert len(SCHEMAS) >= 50
    outputs = llm.chat([ask(f"Give an example of {title} as JSON.") for title, _ in SCHEMAS],
                       [constrained(StructuredOutputs.json_schema(schema))
                        for _, schema in SCHEMAS], use_tqdm=False)
    finished = 0
    for (title, schema), output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        if completion.finish_reason == "length":  # cut by max_tokens: reported, not hidden
            continue
        assert completion.finish_reason == "stop", title
        validate(json.loads(completion.text), schema)
        finished += 1
    assert finished >= len(SCHEMAS) - 2  # bounded schemas: nearly all end by themselves


def test_choice_regex_grammar_and_json_object(llm):
    question = ask("Is the sky blue? Then give a phone number.")
    cases = [
        (StructuredOutputs("choice", choices=("yes", "no", 'it "depends"')),
         lambda text: text in ("yes", "no", 'it "depends"')),
        (StructuredOutputs("regex", r"[0-9]{3}-[0-9]{4}"),
         lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) is not None),
        (StructuredOutputs("grammar", 'start: "answer: " WORD\nWORD: /[a-z]{1,12}/'),
         lambda text: re.fullmatch(r"answer: [a-z]{1,12}", text) is not None),
        (StructuredOutputs("grammar", 'root ::= "A" | "B" "B"'),  # GBNF
         lambda text: text in ("A", "BB")),
        (StructuredOutputs("json_object"), lambda text: isinstance(json.loads(text), dict)),
    ]
    outputs = llm.chat([question] * len(cases), [constrained(spec) for spec, _ in cases],
                       use_tqdm=False)
    for (spec, check), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (spec, completion.text)
        assert check(completion.text), (spec, completion.text)


def test_sampled_n2_each_sample_has_its_own_matcher(llm):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}},
              "required": ["word"], "additionalProperties": False}
    params = constrained(StructuredOutputs.json_schema(schema), n=2, temperature=1.0, seed=7)
    [output] = llm.chat(ask("Say a word as JSON."), params, use_tqdm=False)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        if completion.finish_reason == "stop":
            validate(json.loads(completion.text), schema)
    [again] = llm.chat(ask("Say a word as JSON."), params, use_tqdm=False)
    assert [c.text for c in again.outputs] == [c.text for c in output.outputs]  # seeded


def test_a_grammar_complete_before_max_tokens_stops_without_eos(llm):
    [output] = llm.chat(ask("Pick one."), constrained(
        StructuredOutputs("choice", choices=("alpha",)), ignore_eos=True, max_tokens=50),
        use_tqdm=False)
    assert output.outputs[0].text == "alpha" and output.outputs[0].finish_reason == "stop"


def test_min_tokens_does_not_fight_a_finished_grammar(llm):
    [output] = llm.chat(ask("Pick one."), constrained(
        StructuredOutputs("choice", choices=("no",)), min_tokens=5), use_tqdm=False)
    assert output.outputs[0].text == "no"


def test_logit_bias_and_allowed_token_ids(llm, tokenizer):
    token = tokenizer.encode("banana", add_special_tokens=False)[0]
    [biased] = llm.chat(ask("Hello"), SamplingParams(temperature=0.0, max_tokens=3,
                                                     logit_bias={token: 100.0}), use_tqdm=False)
    assert biased.outputs[0].token_ids == [token] * 3
    allowed = tokenizer.encode(" one two", add_special_tokens=False)
    [limited] = llm.chat(ask("Count"), SamplingParams(temperature=0.9, seed=1, max_tokens=6,
                                                      allowed_token_ids=allowed),
                         use_tqdm=False)
    assert set(limited.outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs("regex", "(ab"), "unclosed group"),
    (StructuredOutputs("json", '{"type": "foo"}'), "foo"),
    (StructuredOutputs("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_a_bad_spec_is_a_clear_error_and_leaves_nothing_queued(llm, spec, message):
    with pytest.raises(GrammarError, match=message):
        llm.chat(ask("Hi"), constrained(spec), use_tqdm=False)
    assert not llm.engine.has_unfinished


def test_spec_and_token_checks():
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs("json", "{nope")
    with pytest.raises(ValueError, match="one constraint"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.choices == ("a",)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [1, 2]},
                     SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


@pytest.fixture(scope="module")
def xgrammar_llm():
    pytest.importorskip("xgrammar")  # in requirements.txt; skipped only where not installed
    return LLM(dtype="float32", num_kv_blocks=256, structured_outputs_backend="xgrammar")


def test_the_xgrammar_backend_gives_the_same_kinds_of_valid_output(xgrammar_llm):
    cases = [StructuredOutputs.json_schema(schema) for _, schema in SCHEMAS[:12]]
    cases += [StructuredOutputs("choice", choices=("yes", "no")),
              StructuredOutputs("regex", r"[0-9]{3}"),
              StructuredOutputs("grammar", 'root ::= "go " ("north" | "south")')]
    outputs = xgrammar_llm.chat([ask("Answer as asked.")] * len(cases),
                                [constrained(spec) for spec in cases], use_tqdm=False)
    for spec, output in zip(cases, outputs):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", (spec, text)
        if spec.kind == "json":
            validate(json.loads(text), json.loads(spec.value))
    assert outputs[-3].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", outputs[-2].outputs[0].text)
    assert outputs[-1].outputs[0].text in ("go north", "go south")
    with pytest.raises(GrammarError):
        xgrammar_llm.chat(ask("Hi"), constrained(StructuredOutputs("regex", "(ab")),
                          use_tqdm=False)


def test_bad_words_ban_a_word_after_its_prefix(llm, tokenizer):
    question = ask("What is the capital of France? Answer in one sentence.")
    [plain] = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert "Paris" in plain.outputs[0].text
    words = [tokenizer.encode(variant, add_special_tokens=False) for variant in ("Paris", " Paris")]
    [banned] = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=20,
                                                 bad_words_token_ids=words), use_tqdm=False)
    output = banned.outputs[0].token_ids
    for word in words:
        assert not any(output[i:i + len(word)] == word for i in range(len(output)))


def test_bad_word_bans_follow_the_output():
    from kvrelay.engine.request import Request
    from kvrelay.engine.stop_checker import banned_token_ids
    request = Request("r", [1, 2], SamplingParams(bad_words_token_ids=[[7], [5, 6], [4, 5, 9]]))
    assert banned_token_ids(request) == [7]
    request.append_token(5)
    assert banned_token_ids(request) == [7, 6]
    request.output_token_ids[:] = [4, 5]
    assert banned_token_ids(request) == [7, 6, 9]  # [5, 6] too: its prefix 5 ends it


def test_preemption_under_a_tiny_kv_pool_keeps_outputs_valid(llm):
    # 16 blocks of 16 tokens cannot hold these sequences at once (long strings keep some of
    # them going to max_tokens): the scheduler preempts and recomputes, each matcher stays with
    # its sample's tokens, and greedy outputs equal those of a pool large enough for all.
    long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}},
                 "required": ["text"], "additionalProperties": False}
    schemas = [schema for _, schema in SCHEMAS[:4]] + [long_text] * 3
    conversations = [ask(f"Example {i} as JSON.") for i in range(len(schemas))]
    params = [constrained(StructuredOutputs.json_schema(s), max_tokens=64) for s in schemas]
    small = LLM(dtype="float32", num_kv_blocks=16)
    outputs = small.chat(conversations, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    roomy = llm.chat(conversations, params, use_tqdm=False)
    for schema, output, reference in zip(schemas, outputs, roomy):
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        if output.outputs[0].finish_reason == "stop":
            validate(json.loads(output.outputs[0].text), schema)
    assert not small.engine.has_unfinished
    assert small.engine.scheduler.kv.num_free_blocks == 16
