"""The stack's shape: which services run, on which ports, with which command lines.

Pure data and arithmetic, no processes, so `kvrelay up`'s topology is easy to read and test.
Internal gRPC ports come first in one block from `--base-port` (tokenizer, scheduler, workers),
their metrics ports right after; the gateway takes the public `--port` (REST) and `--grpc-port`.
"""
from __future__ import annotations

import os
import sys
from argparse import Namespace
from dataclasses import dataclass, field

TOPOLOGIES = ("pd", "colocated")


@dataclass(slots=True)
class ServiceSpec:
    name: str  # unique within the stack: tokenizer, scheduler, prefill-0, decode-0, gateway
    kind: str  # the `kvrelay` subcommand
    argv: list[str]  # everything after `python -m services.cli`
    address: str  # host:port of its gRPC server (health lives there)
    metrics_url: str
    role: str = ""  # workers only
    depends_on: tuple[str, ...] = ()  # start only once these are SERVING
    env: dict[str, str] = field(default_factory=dict)  # on top of the inherited environment
    rest_url: str = ""  # the gateway's REST base, also health-checked

    def command(self) -> list[str]:
        """The service as one would start it by hand (`up` adds a parent-death guard)."""
        return [sys.executable, "-m", "services.cli", self.kind, *self.argv]


def connect_host(host: str) -> str:
    """The address other processes dial when a server binds `host` (wildcards mean loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def worker_roles(args: Namespace) -> list[tuple[str, str]]:
    """[(name, role)] of the workers the topology runs."""
    if args.topology == "colocated":
        return [(f"worker-{i}", "both") for i in range(args.num_workers)]
    return ([(f"prefill-{i}", "prefill") for i in range(args.num_prefill_workers)]
            + [(f"decode-{i}", "decode") for i in range(args.num_decode_workers)])


def threads_per_worker(args: Namespace, num_workers: int) -> int:
    """Workers are the only processes doing heavy math; the others get one thread each. A
    prefill and a decode worker are rarely both at full load (prompts arrive, then decode), so
    up to two workers each get every core: on chat-64 with 2 cores the PD stack made 294 tok/s
    with 2 threads per worker against 247 with the cores split (BENCHMARKS.md)."""
    if args.threads_per_worker:
        return args.threads_per_worker
    if num_workers <= 2:
        return usable_cpus()
    return max(1, usable_cpus() // num_workers)


def usable_cpus() -> int:
    # The CPUs this process may run on (taskset, container cpusets), not all the host has.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def num_internal_ports(args: Namespace) -> int:
    """How many consecutive ports from --base-port the stack uses (gRPC + metrics)."""
    return 2 * (2 + len(worker_roles(args)))


def plan_stack(args: Namespace) -> list[ServiceSpec]:
    """Every service of the stack, in start order (the gateway last)."""
    host, dial = args.host, connect_host(args.host)
    roles = worker_roles(args)
    names = ["tokenizer", "scheduler", *(name for name, _ in roles)]
    grpc_ports = {name: args.base_port + i for i, name in enumerate(names)}
    metrics_ports = {name: args.base_port + len(names) + i for i, name in enumerate(names)}
    common = ["--host", host, "--log-level", args.log_level]

    def internal(name: str) -> list[str]:
        return [*common, "--port", str(grpc_ports[name]),
                "--metrics-port", str(metrics_ports[name])]

    def spec(name: str, kind: str, argv: list[str], **kwargs) -> ServiceSpec:
        return ServiceSpec(name=name, kind=kind, argv=argv,
                           address=f"{dial}:{grpc_ports[name]}",
                           metrics_url=f"http://{dial}:{metrics_ports[name]}/metrics", **kwargs)

    tokenizer_address = f"{dial}:{grpc_ports['tokenizer']}"
    scheduler_address = f"{dial}:{grpc_ports['scheduler']}"
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    services = [
        spec("tokenizer", "tokenizer",
             internal("tokenizer") + _optional(args, "--model"), env=dict(one_thread)),
        spec("scheduler", "scheduler",
             internal("scheduler") + _scheduler_flags(args), env=dict(one_thread)),
    ]
    num_threads = threads_per_worker(args, len(roles))
    for name, role in roles:
        argv = internal(name) + [
            "--role", role, "--worker-id", name,
            "--advertise-address", f"{dial}:{grpc_ports[name]}",
            "--scheduler-address", scheduler_address,
            "--num-threads", str(num_threads),
            *_optional(args, "--model", "--dtype", "--kv-cache-memory", "--num-kv-blocks")]
        # Workers start after the tokenizer is SERVING: it resolves the model first, so on a
        # fresh machine the GGUF is converted once rather than by every process at once.
        services.append(spec(name, "worker", argv, role=role,
                             depends_on=("tokenizer", "scheduler"),
                             env={"OMP_NUM_THREADS": str(num_threads)}))
    services.append(_gateway(args, dial, tokenizer_address, scheduler_address, one_thread))
    return services


def _gateway(args: Namespace, dial: str, tokenizer_address: str, scheduler_address: str,
             env: dict[str, str]) -> ServiceSpec:
    argv = ["--host", args.host, "--log-level", args.log_level,
            "--port", str(args.port), "--grpc-port", str(args.grpc_port),
            "--tokenizer-address", tokenizer_address, "--scheduler-address", scheduler_address,
            *_optional(args, "--served-model-name", "--api-key")]
    rest_url = f"http://{dial}:{args.port}"
    return ServiceSpec(name="gateway", kind="gateway", argv=argv,
                       address=f"{dial}:{args.grpc_port}", metrics_url=f"{rest_url}/metrics",
                       depends_on=("tokenizer", "scheduler"), env=dict(env), rest_url=rest_url)


def _scheduler_flags(args: Namespace) -> list[str]:
    flags = _optional(args, "--max-num-batched-tokens", "--kv-transport")
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def _optional(args: Namespace, *flags: str) -> list[str]:
    """`--flag value` for each flag the user set; unset ones keep the service's own default."""
    argv = []
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    return argv
