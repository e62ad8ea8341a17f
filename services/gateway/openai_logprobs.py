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


def prompt_logprobs_json(entries: list[TokenLogprob], num_top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob,
    rank, decoded_token}} for it and its top num_top alternatives."""
    result: list[dict | None] = [None]
    for entry in entries[1:]:
        item = {str(top.token_id): {"logprob": _value(top.logprob), "rank": rank,
                                    "decoded_token": top.text}
                for rank, top in enumerate(entry.top[:num_top], start=1)}
        item[str(entry.token_id)] = {"logprob": _value(entry.logprob), "rank": entry.rank,
                                     "decoded_token": entry.text}
        result.append(item)
    return result


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

    def prompt(self, entries: list[TokenLogprob], num_top: int) -> dict:
        """The echoed prompt's lists (echo with logprobs): its first token has no logprob, as
        in OpenAI's legacy completions; then the offsets go on after the echoed text."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            tokens.append(entry.text)
            offsets.append(self.text_offset)
            self.text_offset += len(entry.text)
            if entry.logprob is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_value(entry.logprob))
            top = {top.text: _value(top.logprob) for top in entry.top[:num_top]}
            top[entry.text] = _value(entry.logprob)
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}


def joined(first: dict, second: dict) -> dict:
    """Two runs of completions' logprob lists, one after the other."""
    return {key: first[key] + second[key] for key in first}

