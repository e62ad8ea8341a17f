"""When a sequence stops, after each sampled token."""
from __future__ import annotations

import logging

from kvrelay.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


def advance_grammar(request: Request) -> RequestStatus | None:
    """Feed the last token to the request's grammar matcher: STOPPED once the grammar is
    complete (a finished choice, a closed JSON value) or if it refused the token, which the
    sampler's mask prevents; the text so far is then the longest valid prefix."""
    if request.grammar is None:
        return None
    if not request.grammar.accept(request.output_token_ids[-1]):
        log.warning("grammar refused a sampled token of sequence %s", request.sequence_id)
        return RequestStatus.FINISHED_STOPPED
    return RequestStatus.FINISHED_STOPPED if request.grammar.is_terminated else None


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    params = request.params
    num_output = request.num_output_tokens
    last = request.output_token_ids[-1]
    if num_output >= params.min_tokens:
        if last in params.stop_token_ids:
            request.stop_token_id = last
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and last in request.eos_token_ids:
            request.stop_token_id = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def banned_token_ids(request: Request, drafts: list[int] = ()) -> list[int]:
    """Tokens that must not be sampled next (after `drafts`, where a speculative step verifies
    them): the stop tokens until min_tokens are out, and the last token of each bad word whose
    other tokens end the output. (Where a grammar then leaves nothing, the sampler drops the
    bans: sampler.py.)"""
    params = request.params
    output = request.output_token_ids
    if drafts and params.bad_words_token_ids:
        output = output + list(drafts)
    banned = _bad_word_bans(output, params.bad_words_token_ids)
    if request.num_output_tokens + len(drafts) < params.min_tokens:
        banned.extend(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(request.eos_token_ids)
    return banned


def _bad_word_bans(output: list[int], words: list[list[int]]) -> list[int]:
    bans = []
    for word in words:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= len(output) and output[-prefix:] == word[:-1]):
            bans.append(word[-1])
    return bans
