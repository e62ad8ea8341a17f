"""Chat prompts of different lengths for the engine tests (deterministic, no randomness)."""
from __future__ import annotations

SYSTEM_PROMPT = (
    "You are a careful assistant for a small engineering team. Answer briefly and concretely. "
    "When you are unsure, say so. Prefer short lists over long paragraphs. " * 3
)

_PARAGRAPHS = [
    "The harbour town woke slowly: fishermen mended nets, gulls argued over scraps, and the "
    "baker's oven filled the narrow streets with the smell of bread.",
    "A paged KV cache splits every sequence into fixed-size blocks, so memory is allocated on "
    "demand and sequences that share a prefix can share the same physical blocks.",
    "In 1854 John Snow mapped cholera deaths around a water pump in London and argued that the "
    "disease spread through contaminated water rather than through bad air.",
    "To bake sourdough, feed the starter the night before, mix flour and water, rest the dough, "
    "fold it every half hour, shape it, proof it overnight and bake it in a hot covered pot.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; the light "
    "reactions happen in the thylakoid membranes and the Calvin cycle in the stroma.",
    "The committee reviewed the budget line by line, questioned the travel costs, approved the "
    "new laptops, and postponed the decision about the office move until spring.",
]


def long_text(num_paragraphs: int) -> str:
    return " ".join(_PARAGRAPHS[i % len(_PARAGRAPHS)] for i in range(num_paragraphs))


USER_MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in two sentences.",
    "Summarise this text in one sentence: " + long_text(3),
    "List three uses of a paperclip.",
    "Read the notes below and tell me which topic appears most often.\n" + long_text(12),
    "Give me a short recipe for pancakes.",
    "Here is a long document. What is its main subject?\n" + long_text(24),
]


def chat_conversations(with_system: bool = False) -> list[list[dict]]:
    conversations = []
    for message in USER_MESSAGES:
        conversation = [{"role": "user", "content": message}]
        if with_system:
            conversation.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        conversations.append(conversation)
    return conversations
