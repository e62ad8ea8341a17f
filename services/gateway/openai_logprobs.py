"""Logprobs in the two OpenAI shapes: chat's `content` list and completions' four lists."""
from __future__ import annotations

from kvrelay.gateway.request_state import TokenLogprob

# JSON has no -inf; vLLM reports impossible tokens as this.
LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprobs(entries: list[TokenLogprob]) -> list[dict]:
    """`choices[].logprobs.content` entries: the sampled token and its top alternatives."""
    return [{"token": entry.text, "logprob": _value(entry.logprob),
             "bytes": list(entry.text.encode()),
             "top_logprobs": [{"token": top.text, "logprob": _value(top.logprob),
                               "bytes": list(top.text.encode())} for top in entry.top]}
            for entry in entries]


class CompletionLogprobs:
    """Accumulates one choice's `{tokens, token_logprobs, top_logprobs, text_offset}`;
    offsets count characters of the choice's text, after the echoed prompt if any."""

    def __init__(self, text_offset: int = 0) -> None:
        self.text_offset = text_offset

    def step(self, entries: list[TokenLogprob]) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            tokens.append(entry.text)
            token_logprobs.append(_value(entry.logprob))
            top = {top.text: _value(top.logprob) for top in entry.top}
            top[entry.text] = _value(entry.logprob)
            top_logprobs.append(top)
            offsets.append(self.text_offset)
            self.text_offset += len(entry.text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}

