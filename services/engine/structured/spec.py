"""What a request constrains its output to: one of a JSON schema, any JSON object, a regex, a
choice of strings, or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it).

Plain data, no backend: it travels in SamplingParams through every service, and its `key` is
what compiled grammars are cached under.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Where the constraint starts, for models that think first in <think>...</think>: "" at the
# first token; "optional" after a <think>...</think> block if the output opens with one;
# "inside" after the first </think> (the prompt ended inside the block).
AFTER_REASONING = ("", "optional", "inside")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# JSON's whitespace between tokens, where a request allows any (vLLM's default; kvrelay's is
# none: a small model can pad with whitespace until max_tokens)
ANY_WHITESPACE = r"[\x20\x0A\x0D\x09]+"
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar bigger than this is refused
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """kind: one of KINDS. value: the JSON schema as JSON text (json), the regex (regex), the
    grammar text (grammar), "" (json_object). choices: the strings (choice). after_reasoning:
    one of AFTER_REASONING. whitespace_pattern (json, json_object): a regex of the whitespace
    allowed between JSON tokens; "": none (compact JSON)."""
    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()
    after_reasoning: str = ""
    whitespace_pattern: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if self.after_reasoning not in AFTER_REASONING:
            raise ValueError(f"after_reasoning must be one of {AFTER_REASONING}, got "
                             f"{self.after_reasoning!r}")
        if self.whitespace_pattern and self.kind not in ("json", "json_object"):
            raise ValueError("a whitespace pattern applies to json and json_object only")
        if len(self.whitespace_pattern) > 256:
            raise ValueError("whitespace_pattern is longer than 256 characters")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output {self.kind} is longer than {MAX_SPEC_CHARS} "
                             "characters")
        if self.kind == "choice":
            self._check_choices()
        elif self.kind == "json":
            self._check_schema()
        elif self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"structured output {self.kind} must not be empty")

    def _check_choices(self) -> None:
        if not self.choices or len(self.choices) > MAX_CHOICES:
            raise ValueError(f"choice needs 1 to {MAX_CHOICES} strings")
        if any(not isinstance(c, str) or not c for c in self.choices):
            raise ValueError("choice must hold non-empty strings")
        if sum(map(len, self.choices)) > MAX_SPEC_CHARS:
            raise ValueError(f"choice strings exceed {MAX_SPEC_CHARS} characters in all")

    def _check_schema(self) -> None:
        try:
            schema = json.loads(self.value)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or a boolean)")

    @property
    def key(self) -> tuple:
        return (self.kind, self.value, self.choices, self.after_reasoning,
                self.whitespace_pattern)

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "StructuredOutputs":
        # Key order kept: it is the order the properties are generated in.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text)


def from_vllm_fields(fields: dict) -> StructuredOutputs | None:
    """vLLM's structured_outputs object ({"json": schema} or regex, choice, grammar,
    json_object): exactly one constraint, or none (None); with its JSON whitespace options
    (disable_any_whitespace, whitespace_pattern)."""
    fields = dict(fields)
    whitespace = _whitespace_pattern(fields.pop("disable_any_whitespace", None),
                                     fields.pop("whitespace_pattern", None))
    spec = _one_constraint(fields)
    if whitespace:
        if spec is None or spec.kind not in ("json", "json_object"):
            raise ValueError("disable_any_whitespace and whitespace_pattern apply to json and "
                             "json_object only")
        spec = dataclasses.replace(spec, whitespace_pattern=whitespace)
    return spec


def _whitespace_pattern(disable_any_whitespace, whitespace_pattern) -> str:
    """vLLM's two JSON whitespace options as a pattern ("": compact). Unset, kvrelay keeps
    compact JSON; disable_any_whitespace false allows any whitespace."""
    if whitespace_pattern is not None:
        if not isinstance(whitespace_pattern, str) or not whitespace_pattern:
            raise ValueError("whitespace_pattern must be a non-empty regex")
        if disable_any_whitespace:
            raise ValueError("whitespace_pattern contradicts disable_any_whitespace")
        return whitespace_pattern
    if disable_any_whitespace is None or disable_any_whitespace:
        return ""
    return ANY_WHITESPACE


def _one_constraint(fields: dict) -> StructuredOutputs | None:
    present = {name: value for name, value in fields.items()
               if value is not None and value is not False}
    unknown = sorted(set(present) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown structured output field(s): {', '.join(unknown)}")
    if len(present) > 1:
        raise ValueError("structured outputs take one constraint, got "
                         f"{', '.join(sorted(present))}")
    if not present:
        return None
    (kind, value), = present.items()
    if kind == "json":
        if not isinstance(value, (dict, bool, str)):
            raise ValueError("json must be a JSON schema (an object, or its JSON text)")
        return StructuredOutputs.json_schema(value)
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "choice":
        if not isinstance(value, (list, tuple)):
            raise ValueError("choice must be a list of strings")
        return StructuredOutputs("choice", choices=tuple(value))
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a string")
    return StructuredOutputs(kind, value)
