"""What one request may ask for: every limit the gateway enforces, declared here once, each a
flag (so also a KVRELAY_* variable), and applied the same way by both front ends (app.py for
REST, grpc_api.py for the public gRPC API).

They are checked before the request costs anything downstream: the body's size before it is
read, text and counts before the tokenizer sees them, prompt tokens before the scheduler does.
A request over a limit gets a 400 (413 for the body) naming the field, or INVALID_ARGUMENT
(RESOURCE_EXHAUSTED for the size) on the gRPC API."""
from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

from kvrelay.common.flags import add_flag
from kvrelay.engine.sampling_params import MAX_LOGPROBS
from kvrelay.gateway.errors import GatewayError, invalid

# Text the model may be given: any Unicode text, control characters included (terminal output
# with ANSI escapes, binary-ish prompts: byte-level tokenizers encode every one, as vLLM and
# OpenAI take them). Only what cannot reach the tokenizer is refused: surrogates, which is what
# invalid UTF-8 becomes when decoded with surrogateescape (openai_limits) or a lone
# \ud800-style JSON escape; neither can be encoded as UTF-8.
_NOT_TEXT = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Limit:
    flag: str
    default: int
    help: str


# field of RequestLimits -> its flag. The defaults leave room for any ordinary client (OpenAI's
# own limits are lower where it has them: 4 stop strings, 20 top_logprobs, 128 choices).
LIMITS = {
    "max_request_body_bytes": Limit(
        "--max-request-body-bytes", 8 << 20,
        "largest REST body / public gRPC message in bytes; larger ones get 413 "
        "(RESOURCE_EXHAUSTED), checked before the body is read"),
    "max_request_text_chars": Limit(
        "--max-request-text-chars", 1 << 20,
        "characters of text in one request, all its strings together (prompts, messages, "
        "stop strings, schemas...)"),
    "max_prompt_tokens": Limit(
        "--max-prompt-tokens", 0,
        "tokens in one prompt (0: only the model's context length, which the scheduler "
        "checks with max_tokens)"),
    "max_prompts": Limit("--max-prompts", 128, "prompts in one /v1/completions or /v1/embeddings request"),
    "max_n": Limit("--max-n", 16, "choices (n) per prompt"),
    "max_messages": Limit("--max-messages", 1024, "chat messages in one request"),
    "max_stop_strings": Limit("--max-stop-strings", 16, "stop strings in one request"),
    "max_stop_string_chars": Limit("--max-stop-string-chars", 256,
                                   "characters in one stop string"),
    "max_logprobs": Limit("--max-logprobs", MAX_LOGPROBS,
                          f"logprobs / top_logprobs per token (at most {MAX_LOGPROBS}, the "
                          "engine's)"),
    "grpc_max_concurrent_streams": Limit(
        "--grpc-max-concurrent-streams", 100,
        "calls in flight on one connection to the public gRPC API (HTTP/2 "
        "SETTINGS_MAX_CONCURRENT_STREAMS: a client's further calls wait for one to end)"),
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    for limit in LIMITS.values():
        add_flag(parser, limit.flag, type=int, default=limit.default, help=limit.help)


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = LIMITS["max_request_body_bytes"].default
    max_request_text_chars: int = LIMITS["max_request_text_chars"].default
    max_prompt_tokens: int = LIMITS["max_prompt_tokens"].default
    max_prompts: int = LIMITS["max_prompts"].default
    max_n: int = LIMITS["max_n"].default
    max_messages: int = LIMITS["max_messages"].default
    max_stop_strings: int = LIMITS["max_stop_strings"].default
    max_stop_string_chars: int = LIMITS["max_stop_string_chars"].default
    max_logprobs: int = LIMITS["max_logprobs"].default
    grpc_max_concurrent_streams: int = LIMITS["grpc_max_concurrent_streams"].default

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value < 0 or (value == 0 and field.name != "max_prompt_tokens"):
                raise SystemExit(f"{LIMITS[field.name].flag} must be positive, got {value}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise SystemExit(f"--max-logprobs must be <= {MAX_LOGPROBS} (the engine's)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RequestLimits":
        return cls(**{name: getattr(args, name) for name in LIMITS})

    def grpc_server_options(self) -> list[tuple[str, int]]:
        """Options of the public gRPC server (its message size is checked by grpc_api.py:
        ServiceServer's own 64 MiB option comes first, and gRPC takes the first)."""
        return [("grpc.max_concurrent_streams", self.grpc_max_concurrent_streams)]

    # ---- checks (each raises a GatewayError naming what is over) -------------------------------
    def check_body_size(self, num_bytes: int) -> None:
        if num_bytes > self.max_request_body_bytes:
            raise GatewayError("too_large", f"the request body is larger than "
                                            f"{self.max_request_body_bytes} bytes")

    def check_texts(self, texts: Iterable[tuple[str, str]]) -> None:
        """texts: (field path such as "messages.0.content", text) for every string of the
        request. Refuses text that is not valid UTF-8, and too much text in all."""
        total = 0
        for path, text in texts:
            total += len(text)
            _check_characters(path, text)
        if total > self.max_request_text_chars:
            raise invalid(f"the request has {total} characters of text; this server takes at "
                          f"most {self.max_request_text_chars}")

    def check_n(self, n: int, param: str = "n") -> None:
        if n > self.max_n:
            raise invalid(f"{param} must be <= {self.max_n}, got {n}", param)

    def check_stop(self, stop: list[str], param: str = "stop") -> None:
        if len(stop) > self.max_stop_strings:
            raise invalid(f"{param} takes at most {self.max_stop_strings} strings, got "
                          f"{len(stop)}", param)
        for text in stop:
            if len(text) > self.max_stop_string_chars:
                raise invalid(f"each of {param} is at most {self.max_stop_string_chars} "
                              f"characters, got one of {len(text)}", param)

    def check_logprobs(self, logprobs: int | None, param: str = "logprobs") -> None:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise invalid(f"{param} must be <= {self.max_logprobs}, got {logprobs}", param)

    def check_messages(self, count: int, param: str = "messages") -> None:
        if count > self.max_messages:
            raise invalid(f"{param} takes at most {self.max_messages} messages, got {count}",
                          param)

    def check_prompts(self, count: int, param: str = "prompt") -> None:
        if count > self.max_prompts:
            raise invalid(f"{param} takes at most {self.max_prompts} prompts, got {count}",
                          param)

    def check_prompt_tokens(self, prompts: list[list[int]], param: str = "prompt") -> None:
        """The gateway's own cap; the model's context length stays the scheduler's check."""
        if not self.max_prompt_tokens:
            return
        longest = max(map(len, prompts), default=0)
        if longest > self.max_prompt_tokens:
            raise invalid(f"the prompt has {longest} tokens; this server takes at most "
                          f"{self.max_prompt_tokens}", param)


def _check_characters(path: str, text: str) -> None:
    """path "": a key of the body itself. The text is never quoted: it is not encodable."""
    if _NOT_TEXT.search(text) is None:
        return
    raise invalid(f"{path or 'the body'} is not valid UTF-8", path.split(".", 1)[0] or None)
