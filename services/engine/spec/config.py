"""`--speculative-config`, as vLLM users write it: one JSON object, validated once."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16  # a verify step's queries per sequence; more is never accepted here


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most drafts one sequence verifies per step
    # n-gram / prompt lookup: the longest suffix of this length range found earlier in the
    # sequence proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # No speculation while this many sequences or more run on the worker (0: never off): a
    # big batch is compute bound, and every draft costs a token of compute. On the 2-core AMX
    # Xeon, grounded served with n-gram drafts against none: 1.44-1.51x at 1 sequence,
    # 1.00-1.07x at 4, 0.88-0.92x at 8 (BENCHMARKS.md, session 26). On a GPU, where a verify
    # step's rows cost little, raise it.
    disable_by_batch_size: int = 5
    # Suffix decoding (vLLM's names): the trees' depth, how many finished requests' outputs
    # the global tree keeps, drafts up to factor x the matched length, and the probability
    # below which a continuation is not proposed.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.prompt_lookup_max > 64:
            raise ValueError(f"prompt_lookup_max must be <= 64, got {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be >= 0")
        if not 1 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ValueError("suffix_decoding_max_tree_depth must be in [1, 256]")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    def allows_batch(self, num_running: int) -> bool:
        return not self.disable_by_batch_size or num_running < self.disable_by_batch_size

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON text, a dict or a config; None, "" and "{}" mean off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f"speculative config needs a method: one of {METHODS}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
