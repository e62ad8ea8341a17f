"""`kvrelay scheduler`'s flags, apart from its entry module so that `kvrelay up` and the
configuration docs read them without starting anything."""
from __future__ import annotations

import argparse

from kvrelay.common.flags import add_flag
from kvrelay.common.lora_flags import add_enable_lora, add_lora_modules
from kvrelay.common.tls import add_tls_flags
from kvrelay.engine.config import GRAMMAR_BACKENDS
from kvrelay.engine.spec.config import SpeculativeConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="0.0.0.0")
    add_flag(parser, "--port", type=int, default=50052)
    add_flag(parser, "--metrics-port", type=int, default=9102, help="0: no metrics endpoint")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=2048,
             help="token budget of one step on one worker")
    add_flag(parser, "--prefill-max-num-batched-tokens", type=int, default=0,
             help="token budget of one step on a prefill-only worker (0: the same as above; "
                  "2048-token steps prefilled a burst 6%% faster than 8192-token ones here, "
                  "and their first tokens come a step at a time: BENCHMARKS.md)")
    add_flag(parser, "--max-num-seqs", type=int, default=128, help="running sequences per worker")
    add_flag(parser, "--long-prefill-token-threshold", type=int, default=384,
             help="while sequences decode (on the worker, or on a decode worker sharing its "
                  "hardware), a prompt with more tokens left than this is prefilled in chunks, "
                  "smaller ones further in as attention over the context grows, unless more "
                  "requests await a first token than sequences decode: then prompts go whole, "
                  "filling the step, until at most one waits (0: a prompt may always take a "
                  "whole step's budget)")
    add_flag(parser, "--long-prefill-chunk-size", type=int, default=192,
             help="a long prompt's chunk at its start (0: the threshold)")
    add_flag(parser, "--max-long-partial-prefills", type=int, default=1,
             help="how many such long prompts may advance in one step")
    add_flag(parser, "--no-prefix-caching", action="store_true")
    add_enable_lora(parser)
    add_lora_modules(parser)
    add_flag(parser, "--max-cpu-loras", type=int, default=64,
             help="LoRA adapters loaded at once (each worker holds them all in host memory)")
    add_flag(parser, "--no-async-scheduling", action="store_true",
             help="plan each step only after the previous one's tokens are back (by default a "
                  "step of plain decodes is planned and sent while the one before it runs)")
    add_flag(parser, "--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    add_flag(parser, "--kv-transport", choices=["grpc", "shm"], default="shm",
             help="how prefill workers push KV pages: shm copies straight into the decode "
                  "worker's cache where both run on one host, and falls back to grpc per pair")
    add_flag(parser, "--shared-compute-steps", choices=["serialize", "split", "overlap"],
             default="split",
             help="workers on the same hardware (same compute domain, e.g. a prefill and a decode "
                  "worker on one machine's CPUs): run their steps one at a time with every "
                  "core (serialize); do that too but, while a prompt longer than "
                  "--long-prefill-token-threshold prefills in chunks, split the CPUs' cores "
                  "between them so the decodes step beside its chunks instead of waiting for "
                  "each (split; never while prompts go first, nor on a GPU); or let them "
                  "overlap and contend")
    add_flag(parser, "--shared-prefill-max-num-batched-tokens", type=int, default=0,
             help="unless shared-compute steps overlap: a prefill worker's step budget while "
                  "a decode worker on the same hardware has sequences running (0: no limit). "
                  "Trades throughput and TTFT for the decodes' inter-token latency "
                  "(BENCHMARKS.md)")
    add_flag(parser, "--kv-transfer-timeout", type=float, default=30.0,
             help="seconds a prefill worker has to push a sample's KV pages; the decode "
                  "blocks of a lost worker's sends are held this long (plus a lease)")
    add_flag(parser, "--max-request-retries", type=int, default=2,
             help="a request whose worker dies (or whose KV transfer fails) is re-prefilled on "
                  "a live worker, its tokens so far as the prompt, this many times at most "
                  "(0: it ends with the error)")
    add_flag(parser, "--worker-wait-timeout", type=float, default=60.0,
             help="seconds such a request waits for a live worker of the role it needs (e.g. "
                  "the one being restarted) before it ends with the error")
    add_flag(parser, "--lease-ms", type=int, default=3000,
             help="a worker silent for this long is declared dead")
    add_flag(parser, "--model", default=None,
             help="the workers' model (directory, .gguf or cached HF repo id): structured "
                  "output compiles grammars for its tokenizer (default: SmolLM2-135M)")
    add_flag(parser, "--structured-outputs-backend", choices=GRAMMAR_BACKENDS,
             default="llguidance", help="grammar backend for structured output and tools")
    add_flag(parser, "--speculative-config", type=_speculative_config, default=None,
             help="speculative decoding on the decode workers, as vLLM takes it: JSON such as "
                  "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                  "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' or method "
                  "\"suffix\"; also disable_by_batch_size (default 5) and the suffix_decoding_* "
                  "keys (default: off)")
    add_flag(parser, "--max-queued-requests", type=int, default=1024,
             help="refuse a request (RESOURCE_EXHAUSTED; the gateway's 503 with Retry-After) "
                  "while this many wait for their first step (0: no limit)")
    add_flag(parser, "--max-queued-prompt-tokens", type=int, default=1 << 20,
             help="the same for the prompt tokens of the waiting requests (0: no limit)")
    add_flag(parser, "--drain-timeout", type=float, default=60.0, help="seconds")
    add_tls_flags(parser)
    add_flag(parser, "--log-level", default="info")


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
