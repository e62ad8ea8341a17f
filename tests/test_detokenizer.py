"""Streamed text equals the full decode, also for multi-byte characters split across tokens."""
from __future__ import annotations

import random

import pytest

from services.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! Plain ASCII text.", "你好，世界！今天天气很好。", "Rockets 🚀, coders 👩‍💻 and flags 🇫🇷.",
         "Ünïcödé àccents, Ελληνικά, русский, العربية."]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_text_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_random_token_streams_match_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer)
        streamed = "".join(detok.step([token]) for token in ids) + detok.finish()
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
