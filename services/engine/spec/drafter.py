"""The scheduler's side of speculation: which sequences draft this step, how many tokens, and
what the verification did (acceptance per sequence, for adaptive k, and for the metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.request import Request
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.engine.spec.ngram import NgramProposer
from kvrelay.engine.spec.state import DraftState
from kvrelay.engine.spec.suffix import SuffixProposer


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters with vLLM's meaning: a draft is one sequence's proposal for one step."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1


def make_proposer(config: SpeculativeConfig):
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)


class Drafter:
    """One per worker core, or shared by the decode workers of a scheduler (the suffix
    proposer's global tree then learns from all of them)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = make_proposer(config)
        self.stats = SpecDecodeStats()

    def drafts(self, request: Request, num_running: int, room: int) -> list[int]:
        """Draft tokens to verify after the request's next token; `room`: the most the step's
        budget and the model's context leave for drafts."""
        if not self.config.allows_batch(num_running) or not speculates(request):
            return []
        state = request.draft_state
        if state is None:
            state = request.draft_state = DraftState(self.config.num_speculative_tokens)
        params = request.params
        limit = min(state.num_drafts, room)
        if params.max_tokens is not None:
            # every step emits one token past its accepted drafts
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return []
        # (a proposer returns at most `limit` tokens)
        drafts, state.index = self.proposer.propose(request, state.index, limit)
        if request.grammar is not None:
            drafts = drafts[:grammar_prefix(request.grammar, drafts)]
        return drafts

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        if request.draft_state is not None:
            request.draft_state.record(num_drafted, num_accepted)

    def on_finished(self, request: Request) -> None:
        self.proposer.on_finished(request)


def speculates(request: Request) -> bool:
    """A seeded random request is not speculated: its seed promises the same output every
    time, and a draw per verified position would make it depend on what was drafted."""
    params = request.params
    if params.disable_speculation:
        return False
    return params.is_greedy or params.seed is None


def grammar_prefix(matcher, drafts: list[int]) -> int:
    """How many leading drafts the grammar accepts, none past the token that completes it
    (the sample stops there); the matcher is left where it was."""
    valid = matcher.valid_prefix(drafts)
    accepted = 0
    while accepted < valid and not matcher.is_terminated:
        matcher.accept(drafts[accepted])
        accepted += 1
    matcher.rollback(accepted)
    return accepted
