"""The gateway's request metrics, with vLLM's names under the `kvrelay:` prefix."""
from __future__ import annotations

from kvrelay.common.metrics import counter, gauge, histogram

REQUEST_SUCCESS = counter("request_success_total", "Finished samples, by finish reason",
                          ("finished_reason",))
E2E_LATENCY = histogram("e2e_request_latency_seconds", "Arrival to last token")
TTFT = histogram("time_to_first_token_seconds", "Arrival to first token")
ITL = histogram("inter_token_latency_seconds", "Time between a request's output steps, per token")
TPOT = histogram("request_time_per_output_token_seconds",
                 "Mean time per output token after the first, per request")
PROMPT_TOKENS = counter("prompt_tokens_total", "Prompt tokens submitted")
GENERATION_TOKENS = counter("generation_tokens_total", "Output tokens delivered")
IN_FLIGHT = gauge("gateway_requests_in_flight", "Requests the gateway is serving now")
DETOKENIZE_RESUMED = counter(
    "gateway_detokenize_resumed_samples_total",
    "Samples whose detokenizer state a new Detokenize stream took over after one broke")
DETOKENIZE_GIVE_UPS = counter(
    "gateway_detokenize_give_ups_total",
    "Times the gateway gave up on the tokenizer (not back within --tokenizer-wait-timeout, or "
    "it refused a batch) and failed the requests waiting on it")


def observe_tokens(state, num_new_tokens: int, tokens_per_sample: int, now: float) -> None:
    """One engine step's tokens for one request (`tokens_per_sample` each for its n samples)."""
    GENERATION_TOKENS.inc(num_new_tokens)
    if not state.first_token_time:
        state.first_token_time = now
        TTFT.observe(now - state.arrival_time)
    else:
        ITL.observe((now - state.last_token_time) / tokens_per_sample)
    state.last_token_time = now


def observe_sample_finished(finish_reason: str) -> None:
    REQUEST_SUCCESS.labels(finish_reason).inc()


def observe_request_finished(state, now: float) -> None:
    E2E_LATENCY.observe(now - state.arrival_time)
    num_decode_tokens = max(sample.num_tokens for sample in state.samples) - 1
    if num_decode_tokens > 0 and state.first_token_time:
        TPOT.observe((state.last_token_time - state.first_token_time) / num_decode_tokens)
