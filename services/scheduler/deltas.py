"""The deltas a sample's gateway receives: its new tokens, its end."""
from __future__ import annotations

from kvrelay.engine.request import RequestStatus
from kvrelay.engine.step_outputs import SequenceUpdate
from kvrelay.scheduler.messages import Delta, FinishReason
from kvrelay.scheduler.records import SampleRecord

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def token_delta(sample: SampleRecord, update: SequenceUpdate) -> Delta:
    request = update.request
    num_new = len(update.new_token_ids)
    return Delta(
        request_id=sample.parent.request_id, index=sample.index,
        new_token_ids=tuple(update.new_token_ids), logprobs=update.new_logprobs,
        # the first delta of the sample says how much of its prompt was a prefix hit (a
        # recovered sample's request holds every output: only its first token's delta is one)
        num_cached_prompt_tokens=(request.num_cached_prompt_tokens
                                  if request.num_output_tokens == num_new else 0),
        prompt_logprobs=(tuple(request.prompt_logprobs[1:])
                         if request.prompt_logprobs is not None
                         and request.num_output_tokens == num_new else ()),
        embedding=request.embedding or (),
        finish_reason=FINISH_REASONS[request.status] if update.finished else None,
        stop_token_id=request.stop_token_id if update.finished else None)


def token_deltas(sample: SampleRecord, update: SequenceUpdate) -> list[Delta]:
    """The step's new tokens as deltas: one, or one per token for a sample with stop strings,
    so that its gateway, which matches them on text, ends it at the token that completes one
    (a speculative step emits several tokens) and counts and returns nothing past it.
    update.new_logprobs: the sample's TokenLogprobs of the new tokens, or none."""
    whole = token_delta(sample, update)
    num_new = len(whole.new_token_ids)
    if num_new == 1 or not sample.parent.params.stop:
        return [whole]
    deltas = []
    for position, token_id in enumerate(whole.new_token_ids):
        last = position == num_new - 1
        deltas.append(Delta(
            request_id=whole.request_id, index=whole.index, new_token_ids=(token_id,),
            logprobs=whole.logprobs[position:position + 1],
            num_cached_prompt_tokens=whole.num_cached_prompt_tokens if position == 0 else 0,
            prompt_logprobs=whole.prompt_logprobs if position == 0 else (),
            embedding=whole.embedding if position == 0 else (),
            finish_reason=whole.finish_reason if last else None,
            stop_token_id=whole.stop_token_id if last else None))
    return deltas


def finish_delta(sample: SampleRecord, reason: FinishReason, error: str = "") -> Delta:
    return Delta(request_id=sample.parent.request_id, index=sample.index,
                 finish_reason=reason, error=error)
