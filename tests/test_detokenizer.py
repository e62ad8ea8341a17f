"""Streamed text equals the full decode, also for multi-byte characters split across tokens."""
from __future__ import annotations

import random

import pytest

from kvrelay.engine.detokenizer import IncrementalDetokenizer

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


@pytest.mark.parametrize("text", TEXTS)
def test_a_resumed_detokenizer_continues_the_text_at_every_split(tokenizer, text):
    """A detokenizer rebuilt from the tokens another one already turned into text (its stream
    was lost) goes on with exactly the rest, wherever the split falls: inside a multi-byte
    character too, whose held-back bytes the rebuilt one holds back the same way."""
    ids = tokenizer.encode(text)
    for split in range(len(ids) + 1):
        lost = IncrementalDetokenizer(tokenizer)
        delivered = "".join(lost.step([token]) for token in ids[:split])
        resumed = IncrementalDetokenizer(tokenizer)
        resumed.resume(ids[:split])
        rest = "".join(resumed.step([token]) for token in ids[split:]) + resumed.finish()
        assert delivered + rest == text, split
