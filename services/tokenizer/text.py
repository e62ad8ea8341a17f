"""What the tokenizer service does to text, without gRPC: chat rendering, per-token pieces,
and the detokenizer states of one Detokenize stream."""
from __future__ import annotations

from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.conversation import check_conversation


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None, reasoning_effort: str = "") -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (with `tools`: the
    tool definitions, for a template that renders them itself, tool_render.py; with
    reasoning_effort: the template's variable of that name, where it reads one).

    Raises ValueError for a malformed conversation, one the template rejects, or a
    reasoning_effort for a template that does not read it."""
    check_conversation(messages)
    for message in messages:
        if not message["role"]:
            raise ValueError(f"a message needs a non-empty 'role', got {message!r}")
    extra = {}
    if reasoning_effort:
        if "reasoning_effort" not in (getattr(tokenizer, "chat_template", None) or ""):
            raise ValueError("reasoning_effort: this model's chat template takes none")
        extra["reasoning_effort"] = reasoning_effort
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
            **extra)
    except Exception as exc:  # jinja's TemplateError and raise_exception() in templates
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc
    # transformers returns a BatchEncoding or a plain list depending on its version.
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def check_token_ids(token_ids, vocab_size: int) -> None:
    if token_ids and max(token_ids) >= vocab_size:
        raise ValueError(f"token id {max(token_ids)} is out of the vocabulary "
                         f"(size {vocab_size})")


def token_pieces(tokenizer, token_ids) -> list[str]:
    """Each token's own text, as vLLM shows logprob tokens (a lone byte of a multi-byte
    character comes out as U+FFFD)."""
    tokens = tokenizer.convert_ids_to_tokens(list(token_ids))
    return [tokenizer.convert_tokens_to_string([token]) for token in tokens]


class DetokenizeSession:
    """The detokenizer states of one Detokenize stream, one per text stream id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def step(self, stream_id: str, new_token_ids, finished: bool,
             skip_special_tokens: bool, resume_token_ids=()) -> str:
        """The text completed by `new_token_ids`; on `finished` also the flushed rest.
        `resume_token_ids`: the tokens of this text stream detokenized on an earlier stream,
        to rebuild its state from (their text is not returned again).

        Raises ValueError for resume tokens of a stream id that already has a state here: the
        caller would get the text of those tokens twice, or lose some."""
        detokenizer = self.detokenizers.get(stream_id)
        if resume_token_ids and detokenizer is not None:
            raise ValueError(f"{stream_id!r} already has a detokenizer state on this stream; "
                             "resume_token_ids go only in its first item")
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens)
            self.detokenizers[stream_id] = detokenizer
            if resume_token_ids:
                detokenizer.resume(list(resume_token_ids))
        text = detokenizer.step(new_token_ids) if new_token_ids else ""
        if finished:
            text += detokenizer.finish()
            del self.detokenizers[stream_id]
        return text

    @property
    def num_open(self) -> int:
        return len(self.detokenizers)
