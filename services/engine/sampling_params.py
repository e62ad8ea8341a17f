"""Per-request sampling and stopping parameters, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvrelay.engine.step_results import POOLINGS
from kvrelay.engine.structured.spec import StructuredOutputs, from_vllm_fields

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI takes 300; vLLM any number
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_TOKENS = 64
# Below this a row is greedy (vLLM's threshold): dividing by a smaller temperature can overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, matched on detokenized text
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus the top k
    # vLLM's prompt_logprobs: each prompt token's logprob (after the first) plus the top k;
    # computed where the prompt is (no prefix-cache hit skips any of it)
    prompt_logprobs: int | None = None
    # An embedding instead of text (pooling.py): "last" or "mean" of the prompt's final hidden
    # states; such a request is one token long (max_tokens 1, n 1) and its token is dropped.
    pooling: str | None = None
    skip_special_tokens: bool = True
    # Output constraints, applied before every other sampling step (sampler.py): the grammar's
    # allowed tokens, then allowed_token_ids, then the bias added to the logits.
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    allowed_token_ids: list[int] | None = None  # None: every token
    # vLLM's bad_words as token sequences: the last token of one is banned wherever the
    # tokens before it end the output so far (a one-token word: always).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Opt out of speculative decoding where the server has it on (outputs are the same; a
    # request may want the steadier per-token latency of plain decoding).
    disable_speculation: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=0)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.pooling is not None:
            self._check_pooling()
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[]", token_id, low=0)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must be non-empty strings, got {text!r}")
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        self._validate_constraints()

    def _validate_constraints(self) -> None:
        if isinstance(self.structured_outputs, dict):  # vLLM's {"json": schema} form
            self.structured_outputs = from_vllm_fields(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs or a dict")
        self.logit_bias = dict(self.logit_bias or {})
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token_id, low=0)
            _check_number(f"logit_bias[{token_id}]", bias, low=-100.0, high=100.0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids needs 1 to {MAX_ALLOWED_TOKEN_IDS} ids")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids[]", token_id, low=0)
        self.bad_words_token_ids = [list(word) for word in self.bad_words_token_ids or ()]
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words")
        for word in self.bad_words_token_ids:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words: each word is 1 to {MAX_BAD_WORD_TOKENS} tokens")
            for token_id in word:
                _check_int("bad_words token id", token_id, low=0)

    def token_ids_used(self) -> list[int]:
        """Token ids named by the parameters, for a range check against the vocabulary."""
        return [*self.stop_token_ids, *self.logit_bias, *(self.allowed_token_ids or ()),
                *(token for word in self.bad_words_token_ids for token in word)]

    @property
    def constrains_tokens(self) -> bool:
        """logit_bias or allowed_token_ids set (a grammar comes per step, as a bitmask)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _check_pooling(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got "
                             f"{self.pooling!r}")
        if self.max_tokens != 1 or self.n != 1:
            raise ValueError("pooling (an embedding) takes max_tokens 1 and n 1")

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a plain dict, rejecting keys this class does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_number(name: str, value, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    _check_range(name, value, low, high)


def _check_range(name: str, value, low, high) -> None:
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
