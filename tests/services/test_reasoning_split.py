"""The reasoning parser's text side, without a model: a reply split into reasoning and answer
the same way however it is chunked, starting inside the block or opening it, with partial tags
held back; and the constraint compiled to hold only after the block (llguidance)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from kvrelay.engine.model_loader import resolve_model_dir
from kvrelay.engine.structured.llguidance_backend import LlguidanceBackend
from kvrelay.engine.structured.spec import StructuredOutputs
from kvrelay.gateway.reasoning import ReasoningSplit, split_whole

CASES = [  # (reply, starts inside) -> (reasoning or None, content)
    (("Let me think.\n</think>\n\nThe answer.", True), ("Let me think.\n", "The answer.")),
    (("\n<think>\nHmm </thin </think>\n{\"a\":1}", False), ("\nHmm </thin ", '{"a":1}')),
    (("No thinking here <think>x</think>", False), (None, "No thinking here <think>x</think>")),
    (("cut short inside </thi", True), ("cut short inside </thi", "")),
    (("<thi", False), (None, "<thi")),
    (("", True), ("", "")),
]


@pytest.mark.parametrize("case, expected", CASES)
def test_whole_replies(case, expected):
    assert split_whole(*case) == expected


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("case, expected", CASES)
def test_streamed_replies_split_the_same_however_chunked(case, expected, seed):
    text, inside = case
    rng, split = random.Random(seed), ReasoningSplit(inside)
    reasoning = content = ""
    start = 0
    while start < len(text):
        size = rng.randint(1, 5)
        piece_reasoning, piece_content = split.feed(text[start:start + size])
        reasoning, content, start = reasoning + piece_reasoning, content + piece_content, \
            start + size
    rest_reasoning, rest_content = split.finish()
    assert (reasoning + rest_reasoning if split.has_reasoning else None,
            content + rest_content) == expected
    assert "</think>" not in content + rest_content or expected[0] is None


@pytest.fixture(scope="module")
def backend():
    tokenizer_json = resolve_model_dir(None) / "tokenizer.json"
    return LlguidanceBackend(tokenizer_json.read_text(), 49152, [2])


def complete(backend, spec: StructuredOutputs, text: str) -> bool:
    """Whether the grammar takes text whole (every token, then nothing but the end)."""
    matcher = backend.compile(spec).matcher()
    tokens = backend._tokenizer.tokenize_str(text)
    return all(matcher.accept(token) for token in tokens) and matcher.accept(2)


SCHEMA = StructuredOutputs.json_schema({"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False})


@pytest.mark.parametrize("spec", [
    SCHEMA, StructuredOutputs("choice", choices=("yes", "no")),
    StructuredOutputs("regex", r"[0-9]+"), StructuredOutputs("grammar", 'start: "x" "y"')])
def test_the_constraint_holds_after_the_reasoning_only(backend, spec):
    answer = {"json": '{"a":1}', "choice": "no", "regex": "42", "grammar": "xy"}[spec.kind]
    inside = dataclasses.replace(spec, after_reasoning="inside")
    assert complete(backend, inside, "Free text {not json} </thin\n</think>\n\n" + answer)
    assert not complete(backend, inside, "Free text</think>\n\nnot the answer")
    assert not complete(backend, inside, answer)  # the block must close first
    optional = dataclasses.replace(spec, after_reasoning="optional")
    assert complete(backend, optional, "<think>Free text</think>" + answer)
    assert complete(backend, optional, answer)
    assert not complete(backend, optional, "Free text " + answer)
    assert not complete(backend, spec, "<think>x</think>" + answer)


def test_the_key_tells_the_modes_apart():
    assert dataclasses.replace(SCHEMA, after_reasoning="inside").key != SCHEMA.key
    with pytest.raises(ValueError, match="after_reasoning"):
        dataclasses.replace(SCHEMA, after_reasoning="later")


@pytest.mark.parametrize("spec", [SCHEMA, StructuredOutputs("json_object"),
                                  StructuredOutputs("choice", choices=("a", "b"))])
def test_the_mode_crosses_the_wire(spec):
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.wire import params_from_proto, params_to_proto
    params = SamplingParams(structured_outputs=dataclasses.replace(spec, after_reasoning="inside"))
    assert params_from_proto(params_to_proto(params)).structured_outputs == \
        params.structured_outputs
