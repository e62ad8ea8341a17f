"""The grammar backend interface: a spec compiles once into a grammar; each sequence gets its
own matcher from it, advanced with every token the sequence accepts.

A bitmask row is int32 [ceil(vocab / 32)], little-endian bit i of word w allowing token
32 * w + i, the layout llguidance and xgrammar both write.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from kvrelay.engine.structured.spec import StructuredOutputs


class GrammarError(ValueError):
    """The spec does not compile: the request is at fault (a 400, with the backend's message)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def check_bitmask_row(row: np.ndarray) -> None:
    """Backends write through a raw pointer: the row must be exactly what they expect."""
    if row.dtype != np.int32 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"]:
        raise ValueError("a bitmask row is 1-D int32 and C-contiguous")


def next_token_bitmask(matcher: "GrammarMatcher", vocab_size: int) -> np.ndarray:
    """The tokens the matcher allows next: int32 [bitmask_words(vocab_size)]."""
    row = np.zeros(bitmask_words(vocab_size), dtype=np.int32)
    matcher.fill_bitmask(row)
    return row


def step_bitmasks(matcher: "GrammarMatcher", draft_token_ids: list[int],
                  vocab_size: int) -> np.ndarray:
    """A speculative step's masks: int32 [1 + drafts, words], row i the tokens allowed after
    the first i drafts (which the grammar accepts: spec/drafter.py checked them)."""
    rows = np.zeros((1 + len(draft_token_ids), bitmask_words(vocab_size)), dtype=np.int32)
    matcher.fill_bitmask(rows[0])
    for position, token_id in enumerate(draft_token_ids, start=1):
        matcher.accept(token_id)
        matcher.fill_bitmask(rows[position])
    matcher.rollback(len(draft_token_ids))
    return rows


class GrammarMatcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False where the grammar does not allow it."""

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into row (int32 [words], C-contiguous)."""

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted tokens."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of token_ids the grammar would accept in turn, without
        accepting any (speculative drafts are checked this way)."""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing but the end of the sequence."""


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Raises GrammarError for a spec that does not compile. May take a while: call it off
        the event loop (compiler.py does)."""
