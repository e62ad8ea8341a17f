"""The default grammar backend: llguidance (Rust, no torch; JSON schemas compile in about a
millisecond and masks are computed lazily, token by token)."""
from __future__ import annotations

import json

import numpy as np

from kvrelay.engine.structured.backend import GrammarError, check_bitmask_row
from kvrelay.engine.structured.spec import StructuredOutputs

# Compact JSON: a flexible-whitespace grammar lets a small model emit whitespace until
# max_tokens runs out (no space after "," or ":" either).
_JSON_OPTIONS = {"whitespace_flexible": False}


class LlguidanceMatcher:
    def __init__(self, matcher) -> None:
        self._matcher = matcher  # llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    def fill_bitmask(self, row: np.ndarray) -> None:
        check_bitmask_row(row)
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher cannot roll back {num_tokens} tokens")

    def valid_prefix(self, token_ids: list[int]) -> int:
        return int(self._matcher.validate_tokens(token_ids)) if token_ids else 0

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class LlguidanceGrammar:
    def __init__(self, template) -> None:
        self._template = template  # an LLMatcher at the start: copied, never advanced

    def matcher(self) -> LlguidanceMatcher:
        return LlguidanceMatcher(self._template.deep_copy())


class LlguidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids) or None)

    def compile(self, spec: StructuredOutputs) -> LlguidanceGrammar:
        grammar = self._grammar_text(spec)
        error = self._llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"invalid {spec.kind}: {error.strip()}")
        template = self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {spec.kind}: {template.get_error().strip()}")
        return LlguidanceGrammar(template)

    def _grammar_text(self, spec: StructuredOutputs) -> str:
        inner = self._constraint_text(spec)
        return inner if not spec.after_reasoning else after_reasoning(inner, spec.after_reasoning)

    def _constraint_text(self, spec: StructuredOutputs) -> str:
        matcher = self._llguidance.LLMatcher
        try:
            if spec.kind == "json":
                return matcher.grammar_from_json_schema(spec.value,
                                                        defaults=_json_options(spec))
            if spec.kind == "json_object":
                return matcher.grammar_from_json_schema('{"type": "object"}',
                                                        defaults=_json_options(spec))
            if spec.kind == "regex":
                return matcher.grammar_from_regex(spec.value)
            if spec.kind == "choice":
                # JSON string literals are Lark string literals: quotes and escapes survive.
                alternatives = " | ".join(json.dumps(choice) for choice in spec.choices)
                return matcher.grammar_from_lark(f"start: {alternatives}")
            return matcher.grammar_from_lark(self._as_lark(spec.value))
        except (ValueError, TypeError, RuntimeError) as exc:  # schema-level errors raise here
            raise GrammarError(f"invalid {spec.kind}: {exc}") from None

    def _as_lark(self, grammar: str) -> str:
        """GBNF (llama.cpp's `root ::= ...`) is converted; anything else is read as Lark."""
        if "::=" in grammar:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                return gbnf_to_lark(grammar)
            except Exception as exc:  # noqa: BLE001 - the converter raises plain Exceptions
                raise GrammarError(f"invalid grammar (GBNF): {exc}") from None
        return grammar


# A <think>...</think> block (its first </think> ends it) and the space after it, as one lexeme:
# the lexer cannot split a free-text lexeme from the closing tag that follows it.
_REASONING = (r"(?s:.*)<\/think>[ \t\r\n]*/ & ~/(?s:.*)<\/think>(?s:.*)<\/think>(?s:.*)/ & "
              r"~/(?s:.*)<\/think>[ \t\r\n]*[^ \t\r\n](?s:.*)/")
_WRAPPERS = {"inside": f"start: REASONING @constraint\nREASONING: /{_REASONING}\n",
             "optional": f"start: REASONING? @constraint\nREASONING: /<think>{_REASONING}\n"}


def _json_options(spec: StructuredOutputs) -> dict:
    """Compact JSON unless the request allows whitespace (whitespace_pattern)."""
    if not spec.whitespace_pattern:
        return _JSON_OPTIONS
    return {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}


def after_reasoning(constraint: str, mode: str) -> str:
    """The constraint (llguidance's grammar JSON, or Lark text) held only after the reasoning
    block: a top-level grammar whose first grammar reads the block, then the constraint's."""
    if constraint.lstrip().startswith("{"):
        grammars = json.loads(constraint)["grammars"]
    else:
        grammars = [{"lark_grammar": constraint}]
    grammars[0] = {**grammars[0], "name": "constraint"}
    return json.dumps({"grammars": [{"lark_grammar": _WRAPPERS[mode]}, *grammars]})
