"""Synthetic chat prompts from a fixed seed: the text of the standard workloads.

The vocabulary is small and regular so that a prompt's token count is predictable (~14 tokens a
sentence with SmolLM2's tokenizer) without loading a tokenizer."""
from __future__ import annotations

import random

_SUBJECTS = ["the city council", "a small bakery", "our build system", "the river delta",
             "a chess engine", "the night shift", "an old lighthouse", "the payment service",
             "a school orchestra", "the weather model", "a mountain village", "the GPU cluster"]
_VERBS = ["planned", "measured", "rebuilt", "argued about", "documented", "ignored",
          "simplified", "tested", "moved", "celebrated", "priced", "redesigned"]
_OBJECTS = ["the spring schedule", "its water supply", "a faster cache", "the old bridge",
            "every opening move", "the quarterly budget", "a new logo", "the backup plan",
            "the concert hall", "rainfall in July", "the ski lift", "memory bandwidth"]
ASKS = ["Summarise the notes above in three bullet points.",
        "What is the most surprising fact above, and why?",
        "Write a short reply to the author of these notes.",
        "Which two items above are most closely related?",
        "Turn the notes above into a to-do list.",
        "Explain the notes above to a ten-year-old."]


def _sentence(rng: random.Random) -> str:
    return (f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
            f"{rng.choice(_OBJECTS)} in {rng.randint(1990, 2026)}.")


def user_message(rng: random.Random, approx_tokens: int) -> str:
    # A sentence is ~14 tokens with this vocabulary; the question adds ~12.
    num_sentences = max(1, (approx_tokens - 12) // 14)
    notes = " ".join(_sentence(rng) for _ in range(num_sentences))
    return f"Notes: {notes}\n\n{rng.choice(ASKS)}"


def chat64(seed: int = 0, count: int = 64) -> list[list[dict]]:
    """64 chat requests with user prompts of ~30-300 tokens."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": user_message(rng, rng.randint(30, 300))}]
            for _ in range(count)]


def shared_prefix(seed: int = 0, count: int = 64, prefix_tokens: int = 1000):
    """`count` requests sharing one ~1,000-token system prompt, each with its own question."""
    rng = random.Random(seed)
    system = "You answer questions about these notes. " + user_message(rng, prefix_tokens)
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Question {i}: {rng.choice(ASKS)}"}]
            for i in range(count)]
