"""`kvrelay worker --role prefill|decode|both`: the model runner behind the step stream, the KV
connector's sender (prefill) and receiver (decode), registered with the scheduler."""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import uuid
from pathlib import Path

from kvrelay.worker.openmp_spin import limit_openmp_spinning

limit_openmp_spinning()  # only takes effect before torch loads (openmp_spin.py says why)

from kvrelay.api.kvrelay.v1 import kv_transfer_pb2, scheduler_pb2, worker_pb2
from kvrelay.api.kvrelay.v1 import kv_transfer_pb2_grpc, worker_pb2_grpc
from kvrelay.common import metrics
from kvrelay.common.tls import install, tls_files_from_args
from kvrelay.common.grpc_server import ServiceServer
from kvrelay.common.log import get_logger
from kvrelay.common.runtime import freeze_heap, run_service
from kvrelay.engine.omp_threads import run_torch_ops_inline
from kvrelay.worker.flags import add_arguments  # `kvrelay worker`'s flags (cli.py)
from kvrelay.worker.compute_domain import boot_id, compute_domain
from kvrelay.worker.kv_connector import (GrpcKvTransport, KvReceiver, KvSender,
                                          KvTransferService, ShmKvTransport)
from kvrelay.engine.parallel.followers import stop_followers
from kvrelay.worker.model_setup import load_worker_model
from kvrelay.worker.other_node import serve_other_node
from kvrelay.worker.rank_group import check_group_flags, group_cache_path, watch_group
from kvrelay.worker.registration import Registration
from kvrelay.worker.step_executor import StepExecutor
from kvrelay.worker.step_service import WorkerService
from kvrelay.worker.warmup import needs_warm_up, warm_up

log = get_logger(__name__)
MODEL_INFO = metrics.gauge("worker_model_info",
                           "1, labelled with the weights' format, the small steps' kernel "
                           "and the KV cache's dtype", ("weights", "small_steps", "kv_cache_dtype"))
ROLES = {"prefill": scheduler_pb2.WORKER_ROLE_PREFILL, "decode": scheduler_pb2.WORKER_ROLE_DECODE,
         "both": scheduler_pb2.WORKER_ROLE_BOTH}


def run(args: argparse.Namespace) -> int:
    check_group_flags(args)
    if args.node_rank > 0:
        return serve_other_node(args)
    run_service(f"worker-{args.role}", serve(args), args.log_level)
    return 0


async def serve(args: argparse.Namespace) -> None:
    install(tls_files_from_args(args))  # this process's identity on every internal hop
    worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    # a pipeline across hosts takes KV pages over gRPC only (it has no shared cache file; its
    # leader sends the other stages theirs: engine/parallel/staged_pages.py)
    transports = [name for name in args.kv_transports.split(",")
                  if name and (args.nnodes == 1 or name == "grpc")]
    shm_path = _shm_path(args, worker_id, transports)
    kv_cache_path, private_cache = group_cache_path(args, worker_id, shm_path)
    server = ServiceServer(args.host, args.port, [
        worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
        kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name])
    service, receiver = WorkerService(_layerwise(args)), KvReceiver()
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server.server)
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferService(receiver),
                                                          server.server)
    server.install_signal_handlers()
    await server.start()  # health answers NOT_SERVING while the model loads
    metrics_server = await metrics.serve_metrics(args.metrics_port, args.host,
                                                 health=lambda: server.serving)
    # Only the compute thread runs torch's OpenMP work: it loads the model and runs every step,
    # and this loop thread's KV page copies run inline (omp_threads.py says why).
    run_torch_ops_inline()
    loaded = await asyncio.get_running_loop().run_in_executor(service.compute, load_worker_model,
                                                              args, kv_cache_path)
    runner = loaded.runner
    if private_cache:
        os.unlink(kv_cache_path)  # every rank has it mapped; nothing else may
    # A follower's death breaks the group: the leader goes too, at once (rank_group.py).
    watching = watch_group(args, loaded.followers)
    if not args.no_warmup and needs_warm_up(runner):
        seconds = await asyncio.get_running_loop().run_in_executor(service.compute, warm_up,
                                                                   runner, args.role)
        log.info("warmed up", seconds=round(seconds, 2))
    executor = StepExecutor(runner, loaded.num_threads)
    if args.enable_lora:
        await asyncio.get_running_loop().run_in_executor(
            service.compute, runner.enable_lora, args.max_loras, args.max_lora_rank,
            executor.held_adapters)
    freeze_heap()  # the model's modules and tensors, too
    service.attach(executor, KvSender(_transports(transports, runner), args.kv_transfer_timeout))
    instance_id = uuid.uuid4().hex
    if runner.kv_pages is not None:
        receiver.attach(runner.kv_pages, instance_id)
    registration = Registration(args.scheduler_address, scheduler_pb2.RegisterWorkerRequest(
        worker_id=worker_id, role=ROLES[args.role],
        address=args.advertise_address or f"127.0.0.1:{server.port}",
        kv_address=args.kv_advertise_address or "",
        num_blocks=runner.num_blocks, block_size=runner.block_size, model=loaded.model_name,
        dtype=str(runner.dtype).removeprefix("torch."), kv_transports=transports,
        host_id=_host_id(), shm_path=shm_path or "", max_model_len=loaded.max_model_len,
        vocab_size=loaded.vocab_size, eos_token_ids=sorted(loaded.eos_token_ids),
        compute_domain=compute_domain(runner.device),
        attention_crossover=loaded.attention_crossover, instance_id=instance_id,
        num_threads=loaded.num_threads, kv_group_windows=runner.kv_layout.windows,
        kv_cache_dtype=runner.kv_cache_dtype_name,
        max_loras=args.max_loras if args.enable_lora else 0,
        max_lora_rank=args.max_lora_rank if args.enable_lora else 0,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size))
    keep_alive = asyncio.create_task(registration.keep_alive())
    await server.set_serving(True)
    dtype = str(runner.dtype).removeprefix("torch.")
    weights = runner.quantization or dtype
    MODEL_INFO.labels(weights, runner.int4_kernel or "none", runner.kv_cache_dtype_name).set(1)
    log.info("worker ready", worker_id=worker_id, port=server.port, role=args.role,
             num_blocks=runner.num_blocks, dtype=dtype, weights=weights,
             kv_cache_dtype=runner.kv_cache_dtype_name,
             small_step_kernel=runner.int4_kernel,
             tensor_parallel_size=args.tensor_parallel_size,
             pipeline_parallel_size=args.pipeline_parallel_size, nnodes=args.nnodes,
             kv_cache_gib=round(runner.num_blocks * runner.bytes_per_block
                                * args.tensor_parallel_size / (1 << 30), 2),
             kv_capacity_tokens=runner.num_blocks * runner.block_size,
             kv_cache_size=loaded.kv_budget_reason)
    try:
        await server.serve_until_stopped(_drain(registration, service), args.drain_timeout)
    finally:
        keep_alive.cancel()
        if metrics_server is not None:
            metrics_server.close()
        await registration.close()
        for event in watching:
            event.set()
        await asyncio.get_running_loop().run_in_executor(service.compute, stop_followers,
                                                         runner.group, loaded.followers)
        if shm_path:
            os.unlink(shm_path)


def _drain(registration: Registration, service: WorkerService):
    async def drain() -> None:
        # The scheduler stops placing work here at the next heartbeat and closes the step
        # stream once this worker's sequences are done.
        registration.draining = True
        await asyncio.sleep(registration.lease_s / 2)
        await service.idle.wait()
    return drain


def _layerwise(args) -> bool:
    if args.layerwise_kv_push == "auto":
        return args.device == "cuda" or (args.device == "auto" and _cuda_available())
    return args.layerwise_kv_push == "on"


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _shm_path(args, worker_id: str, transports: list[str]) -> str | None:
    """Decode-capable CPU workers keep their KV cache in a shared file so same-host prefill
    workers can write pages straight into it."""
    if "shm" not in transports or args.role == "prefill" or args.device == "cuda":
        return None
    _remove_stale_shm_files(args.shm_dir)
    # The pid keeps two workers with the same id (two stacks on one host) from sharing a file.
    return os.path.join(args.shm_dir, f"kvrelay-{worker_id}-{os.getpid()}.kv")


def _remove_stale_shm_files(shm_dir: str) -> None:
    """A worker that was killed leaves its cache file behind; the pid in the name tells."""
    for path in Path(shm_dir).glob("kvrelay-*.kv"):
        pid = path.stem.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def _transports(names: list[str], runner) -> dict:
    transports = {"grpc": GrpcKvTransport()}
    if "shm" in names:
        block_size, num_kv_heads, row_width = runner.kv_pages.page_shape
        block_shape = (runner.slots_per_block, block_size, num_kv_heads, row_width)
        transports["shm"] = ShmKvTransport(block_shape, runner.kv_cache_dtype)
    return transports


def _host_id() -> str:
    """Same boot + same hostname: the shm transport can reach the other worker's file."""
    return f"{socket.gethostname()}:{boot_id()}"
