"""Structured output's own costs, outside any server: grammar compile time over the test
corpus of JSON schemas (each compiled fresh, no cache) and the time to compute the allowed-token
bitmasks of a step at batch 64, as the scheduler does before each step.

    .venv/bin/python -m benchmarks.structured [--backend llguidance|xgrammar]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.summary import percentile
from kvrelay.bench.workloads import CHAT_JSON_SCHEMA
from kvrelay.engine.model_loader import resolve_model_dir
from kvrelay.engine.structured.backend import next_token_bitmask
from kvrelay.engine.structured.compiler import make_backend
from kvrelay.engine.structured.spec import StructuredOutputs
from tests.structured_schemas import SCHEMAS

VOCAB, EOS = 49152, [2]


def compile_times(backend_name: str, tokenizer_json: Path) -> list[float]:
    times = []
    for _, schema in SCHEMAS:
        backend = make_backend(backend_name, tokenizer_json, VOCAB, EOS)  # no cache between
        started = time.perf_counter()
        backend.compile(StructuredOutputs.json_schema(schema)).matcher()
        times.append(time.perf_counter() - started)
    return times


def mask_times(backend_name: str, tokenizer_json: Path, batch: int, steps: int) -> list[float]:
    """Per step: the bitmasks of `batch` matchers, then each advanced by its next token of a
    valid instance of the chat-64-json schema."""
    from llguidance import LLTokenizer
    tokenizer = LLTokenizer(tokenizer_json.read_text(), n_vocab=VOCAB, eos_token=EOS)
    backend = make_backend(backend_name, tokenizer_json, VOCAB, EOS)
    grammar = backend.compile(StructuredOutputs.json_schema(CHAT_JSON_SCHEMA))
    instance = {"title": "A walk", "keywords": ["sun", "path"],
                "answer": "It was a long walk along the river, past the mill. " * 20}
    tokens = _accepted_tokens(grammar, tokenizer, instance)[:steps]
    matchers = [grammar.matcher() for _ in range(batch)]
    times = []
    for token in tokens:
        started = time.perf_counter()
        for matcher in matchers:
            next_token_bitmask(matcher, VOCAB)
        times.append(time.perf_counter() - started)
        for matcher in matchers:
            matcher.accept(token)
    return times


def _accepted_tokens(grammar, tokenizer, instance: dict) -> list[int]:
    """The instance's tokens in the backend's compact form (llguidance writes no spaces after
    separators, xgrammar ", " and ": ")."""
    for separators in ((",", ":"), (", ", ": ")):
        tokens = tokenizer.tokenize_str(json.dumps(instance, separators=separators))
        probe = grammar.matcher()
        if all(probe.accept(token) for token in tokens):
            return tokens
    raise RuntimeError("the instance does not fit the schema")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="llguidance")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    args = parser.parse_args()
    tokenizer_json = resolve_model_dir(None) / "tokenizer.json"
    compiles = compile_times(args.backend, tokenizer_json)
    masks = mask_times(args.backend, tokenizer_json, args.batch, args.steps)
    print(json.dumps({
        "backend": args.backend, "schemas": len(compiles),
        "compile_ms": {"p50": round(percentile(compiles, 50) * 1e3, 2),
                       "p99": round(percentile(compiles, 99) * 1e3, 2),
                       "max": round(max(compiles) * 1e3, 2)},
        "mask_ms_per_step": {"batch": args.batch, "steps": len(masks),
                             "p50": round(percentile(masks, 50) * 1e3, 2),
                             "p99": round(percentile(masks, 99) * 1e3, 2),
                             "mean": round(statistics.mean(masks) * 1e3, 2)}}, indent=1))


if __name__ == "__main__":
    main()
