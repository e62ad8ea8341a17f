"""The optional grammar backend: xgrammar (C++, compiles grammars ahead into token-mask caches;
imports torch, so a scheduler that uses it loads torch too). `pip install xgrammar`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvrelay.engine.structured.backend import GrammarError, check_bitmask_row
from kvrelay.engine.structured.spec import ANY_WHITESPACE, StructuredOutputs


class XgrammarMatcher:
    def __init__(self, matcher) -> None:
        self._matcher = matcher  # xgrammar.GrammarMatcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, row: np.ndarray) -> None:
        import torch
        check_bitmask_row(row)
        self._matcher.fill_next_token_bitmask(torch.from_numpy(row)[None], 0)  # writes into row

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def valid_prefix(self, token_ids: list[int]) -> int:
        # A refused token leaves xgrammar's matcher unchanged; the accepted ones are undone.
        accepted = 0
        for token_id in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XgrammarGrammar:
    def __init__(self, xgrammar, compiled) -> None:
        self._xgrammar, self._compiled = xgrammar, compiled

    def matcher(self) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgrammar.GrammarMatcher(self._compiled))


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer_json_path: Path, vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self._xgrammar = xgrammar
        self.vocab_size = vocab_size
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_json_path.parent)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: StructuredOutputs) -> XgrammarGrammar:
        if spec.after_reasoning:
            raise GrammarError(f"invalid {spec.kind}: a constraint after a reasoning block "
                               "needs the llguidance structured-outputs backend")
        if spec.whitespace_pattern not in ("", ANY_WHITESPACE):
            raise GrammarError(f"invalid {spec.kind}: whitespace_pattern needs the llguidance "
                               "structured-outputs backend (xgrammar allows any whitespace "
                               "or none)")
        compiler = self._compiler
        any_whitespace = spec.whitespace_pattern == ANY_WHITESPACE
        try:
            if spec.kind == "json":
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=any_whitespace)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}',
                                                        any_whitespace=any_whitespace)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                alternatives = " | ".join(json.dumps(choice) for choice in spec.choices)
                compiled = compiler.compile_grammar(f"root ::= {alternatives}")
            elif "::=" in spec.value:  # GBNF / EBNF, xgrammar's own format
                compiled = compiler.compile_grammar(spec.value)
            else:
                compiled = compiler.compile_lark(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {spec.kind}: {exc}") from None
        return XgrammarGrammar(self._xgrammar, compiled)
