"""Incremental detokenization: text for each step's new tokens, never half a character.

The tokenizers library's DecodeStream does the per-token work in Rust and holds back bytes that
do not yet form a whole UTF-8 character. On finish, the streamed text is reconciled with one
full decode, so the concatenated stream always equals decoding all tokens at once.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer._tokenizer  # the Rust tokenizer behind a fast HF tokenizer
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""

    def step(self, new_token_ids: list[int]) -> str:
        """Feed new tokens; return the text they completed."""
        pieces = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            piece = self._stream.step(self._backend, token_id)
            if piece:
                pieces.append(piece)
        new_text = "".join(pieces)
        self.text += new_text
        return new_text

    def resume(self, token_ids: list[int]) -> None:
        """Take tokens whose text was already delivered (by a detokenizer that is gone): the
        state is then as if they had been stepped here, held-back bytes included, so what
        follows continues that text exactly and `finish` reconciles with all of it."""
        self.step(token_ids)

    def finish(self) -> str:
        """Flush: whatever the full decode has beyond what was streamed."""
        full = self._tokenizer.decode(self.token_ids,
                                      skip_special_tokens=self._skip_special_tokens)
        tail = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += tail
        return tail
