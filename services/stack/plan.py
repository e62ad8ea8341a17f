"""The stack's shape: which services run, on which ports, with which command lines.

Pure data and arithmetic, no processes, so `kvrelay up`'s topology is easy to read and test.
Internal gRPC ports come first in one block from `--base-port` (tokenizers, schedulers, workers),
their metrics ports right after, then each gateway's metrics port; gateway i takes the public
`--port` + i (REST) and `--grpc-port` + i. With `--groups G` each scheduler group has its own scheduler and workers
(`g<k>-` before their names) and every gateway sends requests to all groups.
"""
from __future__ import annotations

import os
import sys
from argparse import Namespace
from dataclasses import dataclass, field

from kvrelay.stack.passthrough import passed_on_argv

TOPOLOGIES = ("pd", "colocated")


@dataclass(slots=True)
class ServiceSpec:
    name: str  # unique within the stack: tokenizer, scheduler, prefill-0, decode-0, gateway
    kind: str  # the `kvrelay` subcommand
    argv: list[str]  # everything after `python -m kvrelay.cli`
    address: str  # host:port of its gRPC server (health lives there)
    metrics_url: str
    role: str = ""  # workers only
    depends_on: tuple[str, ...] = ()  # start only once these are SERVING
    env: dict[str, str] = field(default_factory=dict)  # on top of the inherited environment
    rest_url: str = ""  # the gateway's REST base, also health-checked
    tls_dir: str = ""  # certificates of the stack's mutual TLS (`up --tls`); "" when off

    @property
    def tls_role(self) -> str:
        """The role whose certificate this service's internal gRPC server holds; "" when it
        serves plaintext (TLS off, or the gateway, whose gRPC port is the public API)."""
        return self.kind if self.tls_dir and self.kind != "gateway" else ""

    def command(self) -> list[str]:
        """The service as one would start it by hand: `up` runs exactly this, after a
        parent-death guard (child_entry.py), and so never imports kvrelay.cli itself."""
        return [sys.executable, "-m", "kvrelay.cli", self.kind, *self.argv]


def connect_host(host: str) -> str:
    """The address other processes dial when a server binds `host` (wildcards mean loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def worker_roles(args: Namespace) -> list[tuple[str, str]]:
    """[(name, role)] of one group's workers."""
    if args.topology == "colocated":
        return [(f"worker-{i}", "both") for i in range(args.num_workers)]
    return ([(f"prefill-{i}", "prefill") for i in range(args.prefill_workers)]
            + [(f"decode-{i}", "decode") for i in range(args.decode_workers)])


def _numbered(kind: str, index: int, count: int) -> str:
    """`kind` alone when there is one of it (the names a single-group stack always had)."""
    return kind if count == 1 else f"{kind}-{index}"


def group_prefix(group: int, num_groups: int) -> str:
    return "" if num_groups == 1 else f"g{group}-"


def internal_names(args: Namespace) -> list[str]:
    """Every service with a port in the internal block, in port order."""
    names = [_numbered("tokenizer", i, args.tokenizers) for i in range(args.tokenizers)]
    names += [_numbered("scheduler", g, args.groups) for g in range(args.groups)]
    for group in range(args.groups):
        names += [group_prefix(group, args.groups) + name for name, _ in worker_roles(args)]
    return names


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


def tensor_parallel_size(args: Namespace, role: str) -> int:
    """The ranks of a worker's tensor-parallel group: its role's size where set, else the
    stack's."""
    by_role = {"prefill": args.prefill_tensor_parallel_size,
               "decode": args.decode_tensor_parallel_size}.get(role)
    return by_role or args.tensor_parallel_size


def pipeline_parallel_size(args: Namespace, role: str) -> int:
    """The stages of a worker's pipeline: its role's count where set, else the stack's."""
    by_role = {"prefill": args.prefill_pipeline_parallel_size,
               "decode": args.decode_pipeline_parallel_size}.get(role)
    return by_role or args.pipeline_parallel_size


def usable_cpus() -> int:
    # The CPUs this process may run on (taskset, container cpusets), not all the host has.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def num_internal_ports(args: Namespace) -> int:
    """How many consecutive ports from --base-port the stack uses (gRPC + metrics, then the
    gateways' metrics ports)."""
    return 2 * len(internal_names(args)) + args.gateways


def public_ports(args: Namespace) -> list[int]:
    """Each gateway's REST port, then each one's gRPC port."""
    return ([args.port + i for i in range(args.gateways)]
            + [args.grpc_port + i for i in range(args.gateways)])


def plan_stack(args: Namespace) -> list[ServiceSpec]:
    """Every service of the stack, in start order (the gateways last)."""
    host, dial = args.host, connect_host(args.host)
    roles = worker_roles(args)
    names = internal_names(args)
    grpc_ports = {name: args.base_port + i for i, name in enumerate(names)}
    metrics_ports = {name: args.base_port + len(names) + i for i, name in enumerate(names)}
    common = ["--host", host, "--log-level", args.log_level]

    def internal(name: str) -> list[str]:
        return [*common, "--port", str(grpc_ports[name]),
                "--metrics-port", str(metrics_ports[name])]

    def spec(name: str, kind: str, argv: list[str], **kwargs) -> ServiceSpec:
        return ServiceSpec(name=name, kind=kind, argv=argv + tls_flags(args, kind),
                           tls_dir=args.tls_dir or "",
                           address=f"{dial}:{grpc_ports[name]}",
                           metrics_url=f"http://{dial}:{metrics_ports[name]}/metrics", **kwargs)

    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    tokenizers = [_numbered("tokenizer", i, args.tokenizers) for i in range(args.tokenizers)]
    schedulers = [_numbered("scheduler", g, args.groups) for g in range(args.groups)]
    services = [spec(name, "tokenizer", internal(name) + passed_on_argv(args, "tokenizer"),
                     env=dict(one_thread)) for name in tokenizers]
    services += [spec(name, "scheduler", internal(name) + passed_on_argv(args, "scheduler"),
                      env=dict(one_thread)) for name in schedulers]
    num_threads = threads_per_worker(args, len(roles) * args.groups)
    for group, scheduler in enumerate(schedulers):
        for base_name, role in roles:
            name = group_prefix(group, args.groups) + base_name
            ranks = tensor_parallel_size(args, role)
            stages = pipeline_parallel_size(args, role)
            nnodes = args.nnodes if role != "prefill" else 1  # a decoder spans the hosts
            here = max(1, ranks * stages // nnodes)  # this host's processes of the group
            argv = internal(name) + [
                "--role", role, "--worker-id", name,
                "--advertise-address", f"{dial}:{grpc_ports[name]}",
                "--scheduler-address", f"{dial}:{grpc_ports[scheduler]}",
                # a group's ranks split the worker's threads (they must not share cores)
                "--num-threads", str(max(1, num_threads // here)),
                "--tensor-parallel-size", str(ranks),
                "--pipeline-parallel-size", str(stages), "--nnodes", str(nnodes),
                *(["--dist-init-address", args.dist_init_address] if nnodes > 1 else []),
                *passed_on_argv(args, "worker")]
            # Workers start after the tokenizer is SERVING: it resolves the model first, so on a
            # fresh machine the GGUF is converted once rather than by every process at once.
            services.append(spec(name, "worker", argv, role=role,
                                 depends_on=(tokenizers[0], scheduler),
                                 env={"OMP_NUM_THREADS": str(num_threads)}))
    scheduler_addresses = ",".join(f"{dial}:{grpc_ports[name]}" for name in schedulers)
    for index in range(args.gateways):
        tokenizer = tokenizers[index % len(tokenizers)]  # gateways spread over the tokenizers
        metrics_port = args.base_port + 2 * len(names) + index
        services.append(_gateway(args, index, dial, f"{dial}:{grpc_ports[tokenizer]}",
                                 scheduler_addresses, (tokenizer, *schedulers), one_thread,
                                 metrics_port))
    return services


def _gateway(args: Namespace, index: int, dial: str, tokenizer_address: str,
             scheduler_addresses: str, depends_on: tuple[str, ...],
             env: dict[str, str], metrics_port: int) -> ServiceSpec:
    rest_port, grpc_port = args.port + index, args.grpc_port + index
    argv = ["--host", args.host, "--log-level", args.log_level,
            "--port", str(rest_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port),
            "--tokenizer-address", tokenizer_address, "--scheduler-address", scheduler_addresses,
            *passed_on_argv(args, "gateway"),
            *tls_flags(args, "gateway")]
    rest_url = f"http://{dial}:{rest_port}"
    return ServiceSpec(name=_numbered("gateway", index, args.gateways), kind="gateway",
                       argv=argv, address=f"{dial}:{grpc_port}",
                       metrics_url=f"http://{dial}:{metrics_port}/metrics",
                       depends_on=depends_on, env=dict(env), rest_url=rest_url,
                       tls_dir=args.tls_dir or "")


def tls_flags(args: Namespace, role: str) -> list[str]:
    """A service's mutual-TLS flags: the stack's CA and its role's certificate (certs.py
    names the files)."""
    if not args.tls_dir:
        return []
    flags = ["--tls-ca", os.path.join(args.tls_dir, "ca.pem"),
             "--tls-cert", os.path.join(args.tls_dir, f"{role}.pem"),
             "--tls-key", os.path.join(args.tls_dir, f"{role}-key.pem")]
    crl = getattr(args, "tls_crl_file", None)  # set by `up` when the directory has crl.pem
    return flags + (["--tls-crl", crl] if crl else [])
