"""`kvrelay scheduler`: the engine core as a service."""
from __future__ import annotations

import argparse
import asyncio

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common import metrics
from kvrelay.common.tls import install, tls_files_from_args
from kvrelay.common.grpc_server import ServiceServer
from kvrelay.common.lora_flags import parse_lora_modules
from kvrelay.common.log import get_logger
from kvrelay.common.runtime import run_service
from kvrelay.engine.config import EngineConfig
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.flags import add_arguments  # `kvrelay scheduler`'s flags (cli.py)
from kvrelay.scheduler.service import SchedulerService

log = get_logger(__name__)


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
                          speculative_config=args.speculative_config,
                          enable_lora=args.enable_lora)
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
        max_request_retries=args.max_request_retries, worker_wait_s=args.worker_wait_timeout,
        lora_modules=parse_lora_modules(args.lora_modules), max_cpu_loras=args.max_cpu_loras)
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
