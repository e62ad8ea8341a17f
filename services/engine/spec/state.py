"""What speculation keeps per sequence: the proposer's index over its tokens, and how many of
its recent drafts were accepted, which sets how many it drafts next (adaptive k)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Weight of the newest step in the running mean of accepted drafts.
_ACCEPT_SMOOTHING = 0.5


@dataclass(slots=True)
class DraftState:
    max_drafts: int  # the configured num_speculative_tokens
    index: Any = None  # the proposer's own structure over this sequence's tokens
    # Running mean of drafts accepted per verified step; starts optimistic, at the maximum.
    mean_accepted: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.mean_accepted < 0:
            self.mean_accepted = float(self.max_drafts)

    @property
    def num_drafts(self) -> int:
        """One more than recent steps accepted (rounded), within [1, max]: a sequence whose
        drafts keep failing probes with one token a step, one whose drafts hold goes to the
        maximum."""
        return max(1, min(self.max_drafts, int(self.mean_accepted + 0.5) + 1))

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.mean_accepted += _ACCEPT_SMOOTHING * (num_accepted - self.mean_accepted)
