"""Stop strings on real detokenizer output: cut at the first stop, never split across deltas,
counted through the token that completed it (as the offline engine counts)."""
from __future__ import annotations

import pytest

from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.gateway.stop_strings import StopStringMatcher

CASES = [
    ("The capital of France is Paris. It is lovely.", ["Paris"]),
    ("The capital of France is Paris. It is lovely.", [". It", "lovely"]),
    ("Say hello world, then hello again.", ["hello again", "world,"]),
    ("你好，世界！今天天气很好。", ["世界"]),
    ("Rockets 🚀 fly to the moon 🌙 tonight.", ["🌙"]),
    ("abcdefgh", ["cde", "d"]),  # the shorter one completes first and wins
    ("nothing to see here", ["here!", "zzz"]),  # a partial match at the very end
    ("The end", ["The"]),  # a stop at the very start
]


def _stream(tokenizer, ids: list[int]) -> list[str]:
    """The per-token text the tokenizer service would send: empty while a character is split."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.step([token]) for token in ids]
    pieces[-1] += detokenizer.finish()
    return pieces


def _reference(pieces: list[str], stops: list[str]):
    """The offline engine's rule: after each token, the earliest stop in the text so far."""
    text = ""
    for count, piece in enumerate(pieces, 1):
        text += piece
        found = [(text.find(stop), stop) for stop in stops if stop in text]
        if found:
            position, stop = min(found)
            return count, text[:position], stop
    return len(pieces), text, None


@pytest.mark.parametrize("text,stops", CASES)
def test_stop_strings_on_token_streams(tokenizer, text, stops):
    pieces = _stream(tokenizer, tokenizer.encode(text))
    matcher = StopStringMatcher(stops)
    released, hit, count = [], None, 0
    for count, piece in enumerate(pieces, 1):
        out, hit = matcher.feed(piece, final=count == len(pieces))
        released.append(out)
        if hit is not None:
            break
    assert (count, "".join(released), hit) == _reference(pieces, stops)
    for stop in stops:  # no delta ever shows a piece of a stop string that then completes
        emitted = ""
        for out in released:
            emitted += out
            assert stop not in emitted


def test_held_text_waits_for_the_next_delta():
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("Hello wor") == ("Hello ", None)
    assert matcher.feed("d") == ("word", None)  # "word" can no longer become "world"
    assert matcher.feed(" wo") == (" ", None)
    assert matcher.feed("rld!") == ("", "world")


def test_final_delta_releases_what_was_held():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", None)
    assert matcher.feed("", final=True) == ("</ans", None)
