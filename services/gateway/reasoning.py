"""Reasoning, for models that think inside <think>...</think> before they answer (Qwen3,
DeepSeek-R1 and their kin), turned on with the gateway's --reasoning-parser: the reply's text
split, as it streams, into the reasoning (chat's `reasoning_content`, the Responses API's
reasoning item) and the answer (`content`, where tool calls are read); and where the request
constrains its output (structured output, tools), the constraint moved after the reasoning.

Whether the reply starts inside the block is read from the prompt: a template that opens the
block itself (its generation prompt ends with <think>, as DeepSeek-R1's does) leaves the model
inside it; otherwise the reply is reasoning only if it opens with <think>."""
from __future__ import annotations

import argparse
import dataclasses

from kvrelay.common.flags import add_flag
from kvrelay.engine.structured.spec import THINK_CLOSE, THINK_OPEN, StructuredOutputs
from kvrelay.gateway.tool_call_events import held_back

# vLLM's names for the parsers of this format; each reads it the same way here.
PARSERS = ("none", "think", "qwen3", "deepseek_r1")
_PROMPT_TAIL_TOKENS = 8  # enough for <think> and the space around it in any tokenizer


def add_reasoning_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--reasoning-parser", default="none", choices=PARSERS,
             help="split <think>...</think> reasoning from the answer (chat's "
                  "reasoning_content, the Responses API's reasoning item) and hold structured "
                  "output and tool calls only after it; qwen3 and deepseek_r1 are vLLM's names "
                  "for the same format")


def reasoning_enabled(parser_name: str | None) -> bool:
    return parser_name not in (None, "none")


async def starts_inside(core, prompt: list[int], client_request_id: str) -> bool:
    """Whether the prompt leaves the model inside a <think> block."""
    tail = await core.upstream.decode(prompt[-_PROMPT_TAIL_TOKENS:], client_request_id,
                                      skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_OPEN)


async def with_reasoning(core, prompt: list[int], params, client_request_id: str):
    """(params, inside): without a reasoning parser, the params as they are and None; with
    one, whether the reply starts inside the block and the params' constraint moved after it."""
    if not reasoning_enabled(core.reasoning_parser):
        return params, None
    inside = await starts_inside(core, prompt, client_request_id)
    return dataclasses.replace(params, structured_outputs=after_reasoning(
        params.structured_outputs, inside)), inside


def after_reasoning(spec: StructuredOutputs | None, inside: bool) -> StructuredOutputs | None:
    if spec is None:
        return None
    return dataclasses.replace(spec, after_reasoning="inside" if inside else "optional")


class ReasoningSplit:
    """One choice's text in, (reasoning, content) out, as it streams."""

    def __init__(self, inside: bool) -> None:
        self.state = "reasoning" if inside else "undecided"
        self.pending = ""
        self.has_reasoning = inside
        self.content_started = False  # any content has gone out

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.state == "undecided":
            self._decide()
        if self.state == "reasoning":
            reasoning = self._reasoning()
        if self.state == "after":  # the space after </think> is not the answer's
            self.pending = self.pending.lstrip()
            if self.pending:
                self.state = "content"
        if self.state == "content":
            content, self.pending = self.pending, ""
        self.content_started = self.content_started or bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: a partial tag goes out as what it was inside."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return rest, ""
        if self.state == "after":
            return "", ""
        self.content_started = self.content_started or bool(rest)
        return "", rest

    def _decide(self) -> None:
        head = self.pending.lstrip()
        if head.startswith(THINK_OPEN):
            self.state, self.has_reasoning = "reasoning", True
            self.pending = head[len(THINK_OPEN):]
        elif not THINK_OPEN.startswith(head):  # an empty head may still become the tag
            self.state = "content"

    def _reasoning(self) -> str:
        end = self.pending.find(THINK_CLOSE)
        if end >= 0:
            reasoning = self.pending[:end]
            self.pending = self.pending[end + len(THINK_CLOSE):]
            self.state = "after"
            return reasoning
        keep = held_back(self.pending, THINK_CLOSE)
        reasoning = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(reasoning):]
        return reasoning


def split_whole(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole reply's (reasoning or None, content)."""
    split = ReasoningSplit(inside)
    reasoning, content = split.feed(text)
    rest_reasoning, rest_content = split.finish()
    reasoning += rest_reasoning
    return (reasoning if split.has_reasoning else None), content + rest_content
