"""Checks on chat conversations, shared by the offline API and the tokenizer service (torch-free,
so the tokenizer need not load the model stack)."""
from __future__ import annotations


def check_conversation(conversation) -> None:
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("a conversation is a non-empty list of messages")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"a message needs 'role' and 'content', got {message!r}")
