"""JSON whitespace options (vLLM's disable_any_whitespace and whitespace_pattern): compact JSON
unless asked, any whitespace or a pattern where asked, in both backends (xgrammar takes any or
none and refuses a pattern), and bad combinations refused."""
from __future__ import annotations

import pytest

from kvrelay.engine.model_loader import resolve_model_dir
from kvrelay.engine.structured.backend import GrammarError
from kvrelay.engine.structured.llguidance_backend import LlguidanceBackend
from kvrelay.engine.structured.spec import ANY_WHITESPACE, from_vllm_fields

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPACT, SPACED, NEWLINES = '{"a":1}', '{ "a": 1 }', '{\n  "a": 1\n}'


@pytest.fixture(scope="module")
def tokenizer_json():
    return resolve_model_dir(None) / "tokenizer.json"


@pytest.fixture(scope="module")
def backends(tokenizer_json):
    found = {"llguidance": LlguidanceBackend(tokenizer_json.read_text(), 49152, [2])}
    try:
        from kvrelay.engine.structured.xgrammar_backend import XgrammarBackend
        found["xgrammar"] = XgrammarBackend(tokenizer_json, 49152, [2])
    except ImportError:
        pass
    return found


def takes(backend, spec, text: str) -> bool:
    """Whether the grammar takes the text whole, then the end."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    matcher = backend.compile(spec).matcher()
    return all(matcher.accept(token) for token in tokenizer.encode(text)) and matcher.accept(2)


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_compact_unless_asked_then_any(backends, name):
    backend = backends.get(name) or pytest.skip(f"{name} is not installed")
    compact = from_vllm_fields({"json": SCHEMA})
    assert compact == from_vllm_fields({"json": SCHEMA, "disable_any_whitespace": True})
    # (compact: llguidance writes no space at all, xgrammar one after each colon)
    assert takes(backend, compact, COMPACT if name == "llguidance" else '{"a": 1}')
    assert not takes(backend, compact, NEWLINES)
    flexible = from_vllm_fields({"json": SCHEMA, "disable_any_whitespace": False})
    assert flexible.whitespace_pattern == ANY_WHITESPACE
    assert takes(backend, flexible, SPACED) and takes(backend, flexible, NEWLINES)
    assert takes(backend, from_vllm_fields({"json_object": True,
                                            "disable_any_whitespace": False}), SPACED)


def test_a_pattern_in_llguidance_and_refused_by_xgrammar(backends):
    spaces = from_vllm_fields({"json": SCHEMA, "whitespace_pattern": " ?"})
    llguidance = backends["llguidance"]
    assert takes(llguidance, spaces, SPACED) and not takes(llguidance, spaces, NEWLINES)
    if "xgrammar" in backends:
        with pytest.raises(GrammarError, match="llguidance"):
            backends["xgrammar"].compile(spaces)


@pytest.mark.parametrize("fields, message", [
    ({"regex": "a+", "disable_any_whitespace": False}, "json"),
    ({"disable_any_whitespace": False}, "json"),
    ({"json": SCHEMA, "whitespace_pattern": " ", "disable_any_whitespace": True}, "contradicts"),
    ({"json": SCHEMA, "whitespace_pattern": ""}, "non-empty"),
])
def test_bad_combinations(fields, message):
    with pytest.raises(ValueError, match=message):
        from_vllm_fields(fields)


def test_the_pattern_crosses_the_wire():
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.wire import params_from_proto, params_to_proto
    params = SamplingParams(structured_outputs=from_vllm_fields(
        {"json": SCHEMA, "whitespace_pattern": " ?"}))
    assert params_from_proto(params_to_proto(params)).structured_outputs == \
        params.structured_outputs
