"""Suffix decoding: each sequence's own suffix tree over its prompt and output, plus one
bounded global tree over recent requests' outputs (agents and templated replies repeat
across requests). Both are matched against the sequence's latest tokens; the likelier
continuation is proposed."""
from __future__ import annotations

import math
from collections import deque

from kvrelay.engine.request import Request
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.engine.spec.suffix_tree import SuffixTree, likeliest_path


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.global_tree = SuffixTree(self.max_depth)
        self._cached_outputs: deque[list[int]] = deque()

    def propose(self, request: Request, tree: SuffixTree | None, max_drafts: int
                ) -> tuple[list[int], SuffixTree]:
        if tree is None:
            tree = SuffixTree(self.max_depth)
        tokens = request.all_token_ids
        tree.extend(tokens)
        context = tokens[-(self.max_depth - 1):] if self.max_depth > 1 else []
        best, best_score = [], 0.0
        for source in (tree, self.global_tree):
            node, match_len = source.deepest_match(context, max_drafts)
            if node is None:
                continue
            limit = min(max_drafts, max(1, math.ceil(self.spec_factor * match_len)))
            drafts, score = likeliest_path(node, limit, self.min_prob)
            if score > best_score:
                best, best_score = drafts, score
        return best, tree

    def on_finished(self, request: Request) -> None:
        """A finished sequence's output joins the global tree; the oldest leaves past the bound."""
        if not self.max_cached or not request.output_token_ids:
            return
        output = list(request.output_token_ids)
        self.global_tree.add(output)
        self._cached_outputs.append(output)
        while len(self._cached_outputs) > self.max_cached:
            self.global_tree.remove(self._cached_outputs.popleft())
