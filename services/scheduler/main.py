"""`kvrelay scheduler`: the engine core as a service."""
from __future__ import annotations

import argparse
import asyncio

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common import metrics
from kvrelay.common.flags import add_flag
from kvrelay.common.tls import add_tls_flags, install, tls_files_from_args
from kvrelay.common.grpc_server import ServiceServer
from kvrelay.common.log import get_logger
from kvrelay.common.runtime import run_service
from kvrelay.engine.config import GRAMMAR_BACKENDS, EngineConfig
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.service import SchedulerService

log = get_logger(__name__)


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
                  "smaller ones further in as attention over the context grows (0: a prompt "
                  "may take a whole step's budget)")
    add_flag(parser, "--long-prefill-chunk-size", type=int, default=192,
             help="a long prompt's chunk at its start (0: the threshold)")
    add_flag(parser, "--max-long-partial-prefills", type=int, default=1,
             help="how many such long prompts may advance in one step")
    add_flag(parser, "--no-prefix-caching", action="store_true")
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
                  "--long-prefill-token-threshold prefills, split the CPUs' cores between "
                  "them so the decodes step beside its chunks instead of waiting for each "
                  "(split; a GPU is never split); or let them overlap and contend")
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


def run(args: argparse.Namespace) -> int:
    run_service("scheduler", serve(args), args.log_level)
    return 0


async def serve(args: argparse.Namespace) -> None:
    install(tls_files_from_args(args))  # this process's identity on every internal hop
    engine = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          long_prefill_chunk_size=args.long_prefill_chunk_size,
                          max_long_partial_prefills=args.max_long_partial_prefills,
                          enable_prefix_caching=not args.no_prefix_caching,
                          scheduling_policy=args.scheduling_policy,
                          speculative_config=args.speculative_config)
    config = SchedulerConfig(
        engine=engine, lease_s=args.lease_ms / 1000,
        prefill_max_num_batched_tokens=args.prefill_max_num_batched_tokens or None,
        shared_prefill_max_num_batched_tokens=args.shared_prefill_max_num_batched_tokens or None,
        shared_compute_steps=args.shared_compute_steps,
        async_scheduling=not args.no_async_scheduling,
        transfer_timeout_s=args.kv_transfer_timeout, kv_transport=args.kv_transport,
        model=args.model, structured_outputs_backend=args.structured_outputs_backend,
        max_queued_requests=args.max_queued_requests,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_request_retries=args.max_request_retries, worker_wait_s=args.worker_wait_timeout)
    service = SchedulerService(config)
    server = ServiceServer(args.host, args.port,
                           [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server.server)
    server.install_signal_handlers()
    await server.start()
    metrics_server = await metrics.serve_metrics(args.metrics_port, args.host,
                                                 health=lambda: server.serving)
    reaper = asyncio.create_task(service.reap_leases())
    # The scheduler itself is ready at once; `Stats.ready` tells whether workers are there.
    await server.set_serving(True)
    log.info("scheduler ready", port=server.port)
    try:
        await server.serve_until_stopped(service.drain, args.drain_timeout)
    finally:
        reaper.cancel()
        if metrics_server is not None:
            metrics_server.close()
