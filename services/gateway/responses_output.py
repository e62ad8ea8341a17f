"""One response's output, built from the generated text as it streams: output items (an assistant
message, function calls) and the typed events OpenAI's Responses API streams, in its order:

    response.created, response.in_progress,
    reasoning (with a reasoning parser): response.output_item.added,
                 response.reasoning_text.delta ..., response.reasoning_text.done,
                 response.output_item.done
    per message: response.output_item.added, response.content_part.added,
                 response.output_text.delta ..., response.output_text.done,
                 response.content_part.done, response.output_item.done
    per call:    response.output_item.added, response.function_call_arguments.delta ...,
                 response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, response.failed)

A non-streamed response is built the same way, its events dropped, so both read the same."""
from __future__ import annotations

import copy
import uuid

from kvrelay.gateway.reasoning import ReasoningSplit
from kvrelay.gateway.openai_tools import call_events
from kvrelay.gateway.tool_call_events import CallArguments, CallEnd, CallStart, Content

# finish_reason -> (the response's status, incomplete_details)
_STATUS = {"stop": ("completed", None),
           "length": ("incomplete", {"reason": "max_output_tokens"})}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, fields: dict, tools_format: str | None,
                 inside: bool | None = None, tools=None) -> None:
        """fields: the response object's fields other than status, output, usage, error and
        incomplete_details (id, created_at, model, and the request's settings echoed);
        tools_format: how the reply writes tool calls (None: no tools in play), tools: the
        definitions in play;
        inside: None without a reasoning parser, else whether the reply starts in reasoning."""
        self.fields = fields
        self.output: list[dict] = []
        self.calls = call_events(tools_format, tools) if tools_format is not None else None
        self.split = ReasoningSplit(inside) if inside is not None else None
        self.reasoning: dict | None = None  # the reasoning item being written, if any
        self.num_reasoning_tokens = 0  # the reply's tokens before its answer began
        self.message: dict | None = None  # the message item being written, if any
        self.call_items: dict[int, dict] = {}  # call index -> its item
        self.num_events = 0

    # ---- the whole response ------------------------------------------------------------------
    def response(self, status: str, usage: dict | None = None, error: dict | None = None,
                 incomplete_details: dict | None = None) -> dict:
        return {**self.fields, "object": "response", "status": status, "error": error,
                "incomplete_details": incomplete_details, "output": list(self.output),
                "usage": usage}

    def start(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, text: str, num_tokens: int = 0) -> list[dict]:
        """text: what one step added; num_tokens: its tokens (counted as reasoning tokens
        while the answer has not begun)."""
        if self.split is None:
            return self._answer(text)
        if self.split.has_reasoning and not self.split.content_started:
            self.num_reasoning_tokens += num_tokens
        reasoning, content = self.split.feed(text)
        return self._reasoning_text(reasoning) + self._answer(content)

    def finish(self, finish_reason: str | None, usage: dict) -> tuple[list[dict], dict]:
        """The closing events and the finished response."""
        status, incomplete = _STATUS.get(finish_reason, ("incomplete", {"reason": "aborted"}))
        events = []
        if self.split is not None:
            reasoning, content = self.split.finish()
            events += self._reasoning_text(reasoning) + self._answer(content)
            events += self._close_reasoning(status)
        events += self._apply(self.calls.finish(), cut=True) if self.calls is not None else []
        events += self._close_message(status)
        usage = {**usage, "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens}}
        response = self.response(status, usage, incomplete_details=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)], response

    def failed(self, message: str) -> dict:
        error = {"code": "server_error", "message": message}
        return self._event("response.failed", response=self.response("failed", error=error))

    # ---- items --------------------------------------------------------------------------------
    def _answer(self, text: str) -> list[dict]:
        if not text:
            return []
        events = self._close_reasoning("completed")
        if self.calls is None:
            return events + self._content(text)
        return events + self._apply(self.calls.feed(text))

    def _reasoning_text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.reasoning is None:
            self.reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": ""}],
                              "status": "in_progress"}
            events.append(self._item_added(self.reasoning))
        self.reasoning["content"][0]["text"] += text
        where = {"item_id": self.reasoning["id"],
                 "output_index": self.output.index(self.reasoning)}
        return events + [self._event("response.reasoning_text.delta", **where, content_index=0,
                                     delta=text)]

    def _close_reasoning(self, status: str) -> list[dict]:
        if self.reasoning is None:
            return []
        item, self.reasoning = self.reasoning, None
        item["status"] = "incomplete" if status == "incomplete" else "completed"
        output_index = self.output.index(item)
        return [self._event("response.reasoning_text.done", item_id=item["id"],
                            output_index=output_index, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=output_index, item=item)]

    def _apply(self, parsed, cut: bool = False) -> list[dict]:
        events: list[dict] = []
        for event in parsed:
            if isinstance(event, Content):
                events += self._content(event.text)
            elif isinstance(event, CallStart):
                events += self._call_start(event)
            elif isinstance(event, CallArguments):
                events += self._call_arguments(event)
            elif isinstance(event, CallEnd):
                events += self._call_end(event, "incomplete" if cut else "completed")
        return events

    def _content(self, text: str) -> list[dict]:
        events = []
        if self.message is None:
            self.message = {"id": new_id("msg"), "type": "message", "role": "assistant",
                            "status": "in_progress", "content": []}
            events.append(self._item_added(self.message))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.message["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=dict(part)))
        self.message["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _close_message(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        message, part = self.message, self.message["content"][0]
        self.message = None
        message["status"] = "incomplete" if status == "incomplete" else "completed"
        where = {"item_id": message["id"], "output_index": self.output.index(message)}
        return [self._event("response.output_text.done", **where, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=message)]

    def _call_start(self, event: CallStart) -> list[dict]:
        events = self._close_message("completed")
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": event.name, "arguments": ""}
        self.call_items[event.index] = item
        return events + [self._item_added(item)]

    def _call_arguments(self, event: CallArguments) -> list[dict]:
        item = self.call_items[event.index]
        item["arguments"] += event.text
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=event.text)]

    def _call_end(self, event: CallEnd, status: str) -> list[dict]:
        item = self.call_items[event.index]
        item["arguments"], item["status"] = event.arguments, status
        output_index = self.output.index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=output_index, name=item["name"],
                            arguments=event.arguments),
                self._event("response.output_item.done", output_index=output_index, item=item)]

    # ---- events -------------------------------------------------------------------------------
    def _item_added(self, item: dict) -> dict:
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1,
                           item=copy.deepcopy(item))  # as it is now: its text comes after

    def _where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.output.index(self.message)}

    def _event(self, kind: str, **payload) -> dict:
        event = {"type": kind, "sequence_number": self.num_events, **payload}
        self.num_events += 1
        return event
