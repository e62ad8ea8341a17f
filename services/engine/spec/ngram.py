"""N-gram (prompt lookup) proposer: the longest suffix of the sequence, between
prompt_lookup_min and prompt_lookup_max tokens, that occurred earlier proposes the tokens that
followed it (of equal matches, a recent one with enough tokens after it).

The index maps each prompt_lookup_min-gram to the positions right after its occurrences and
grows with the sequence, so a step costs a few dictionary lookups, not a scan of the context.
"""
from __future__ import annotations

from kvrelay.engine.request import Request
from kvrelay.engine.spec.config import SpeculativeConfig

# Occurrences of one short n-gram examined for a longer match, latest first.
_MAX_CANDIDATES = 8


class NgramIndex:
    __slots__ = ("min_n", "positions", "num_indexed")

    def __init__(self, min_n: int) -> None:
        self.min_n = min_n
        # min_n-gram -> the positions right after each of its occurrences, in order
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.num_indexed = 0  # continuation positions < this are in the index

    def extend(self, tokens: list[int], length: int) -> None:
        """Index every n-gram that ends before position `length - 1` (the current suffix
        itself is not an earlier occurrence)."""
        min_n = self.min_n
        for end in range(max(self.num_indexed, min_n), length):
            self.positions.setdefault(tuple(tokens[end - min_n:end]), []).append(end)
        self.num_indexed = max(self.num_indexed, length)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request, index: NgramIndex | None, max_drafts: int
                ) -> tuple[list[int], NgramIndex]:
        tokens = request.all_token_ids
        length = len(tokens)
        if index is None:
            index = NgramIndex(self.min_n)
        if length <= self.min_n:
            return [], index
        index.extend(tokens, length)
        key = tuple(tokens[length - self.min_n:])
        candidates = index.positions.get(key, ())
        # The longest match wins; between equal ones, the one with more tokens after it
        # (a match near the end has few), then the latest.
        best_start, best_score = -1, (0, 0)
        for start in reversed(candidates[-_MAX_CANDIDATES:]):
            score = (self._match_length(tokens, start, length), min(max_drafts, length - start))
            if score > best_score:
                best_start, best_score = start, score
        if best_start < 0:
            return [], index
        return tokens[best_start:best_start + max_drafts], index

    def _match_length(self, tokens: list[int], start: int, length: int) -> int:
        """How far back the tokens before `start` equal the sequence's suffix (min_n of them
        are known to), up to max_n."""
        match_len = self.min_n
        while (match_len < self.max_n and start - match_len - 1 >= 0
               and tokens[start - match_len - 1] == tokens[length - match_len - 1]):
            match_len += 1
        return match_len

    def on_finished(self, request: Request) -> None:
        pass
