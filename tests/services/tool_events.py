"""What the tool-call readers' tests read out of events: the content and each call's name and
arguments joined from its pieces, checking that each call's end says the same arguments."""
from __future__ import annotations

import json

from kvrelay.gateway.tool_call_events import CallArguments, CallEnd, CallStart, Content


def summary(events, parse: bool = False) -> tuple[str, list[tuple]]:
    """(all content, [(name, arguments)]): the arguments as JSON text, or parsed (parse)."""
    content, calls = "", {}
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index not in calls
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.text
        elif isinstance(event, CallEnd):
            assert calls[event.index][1] == event.arguments
    return content, [(name, json.loads(arguments) if parse else arguments)
                     for name, arguments in calls.values()]


def llguidance_backend():
    """The default model's llguidance backend, as the scheduler builds it."""
    from kvrelay.engine.model_loader import resolve_model_dir
    from kvrelay.engine.structured.llguidance_backend import LlguidanceBackend
    return LlguidanceBackend((resolve_model_dir(None) / "tokenizer.json").read_text(), 49152, [2])


def takes(backend, grammar, text: str) -> bool:
    """Whether the grammar takes text whole: every token of it, then the end."""
    matcher = backend.compile(grammar).matcher()
    return all(matcher.accept(token) for token in backend._tokenizer.tokenize_str(text)) \
        and matcher.accept(2)
