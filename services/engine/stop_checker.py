"""When a sequence stops, after each sampled token."""
from __future__ import annotations

from services.engine.request import Request, RequestStatus


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


def banned_token_ids(request: Request) -> list[int]:
    """Tokens that must not be sampled yet: the stop tokens, until min_tokens are out."""
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(request.eos_token_ids)
    return banned
