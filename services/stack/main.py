"""`kvrelay up`: run tokenizer, scheduler, workers and gateway locally, wait for health, serve.

Default topology `pd`: one prefill and one decode worker; `--topology colocated`: one `--role
both` worker. Every flag is also read from `KVRELAY_<FLAG>`; those variables are not passed on to
the children (which share flag names such as `--port` with a different meaning), the values go
on their command lines instead.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

from kvrelay.common.flags import add_flag, flag_env_names
from kvrelay.stack.passthrough import add_service_flags
from kvrelay.engine.parallel.nodes import NodePlacement
from kvrelay.stack.plan import (TOPOLOGIES, num_internal_ports, pipeline_parallel_size, plan_stack,
                               public_ports, tensor_parallel_size)
from kvrelay.stack.ports import busy_ports
from kvrelay.stack.restarts import DEFAULT_MAX_RESTARTS, RestartPolicy
from kvrelay.stack.supervisor import Supervisor, say

STATE_FILE_NAME = "stack.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--topology", choices=TOPOLOGIES, default="pd",
             help="pd: prefill + decode workers; colocated: --role both workers")
    add_flag(parser, "--prefill-workers", "--num-prefill-workers", type=int, default=1,
             help="prefill workers per group (pd topology)")
    add_flag(parser, "--decode-workers", "--num-decode-workers", type=int, default=1,
             help="decode workers per group (pd topology)")
    add_flag(parser, "--num-workers", type=int, default=1,
             help="--role both workers per group (colocated topology)")
    add_flag(parser, "--prefill-tensor-parallel-size", type=int, default=None,
             help="ranks of each prefill worker's tensor-parallel group (pd topology; "
                  "default: --tensor-parallel-size)")
    add_flag(parser, "--decode-tensor-parallel-size", type=int, default=None,
             help="ranks of each decode worker's tensor-parallel group (pd topology; "
                  "default: --tensor-parallel-size)")
    add_flag(parser, "--prefill-pipeline-parallel-size", type=int, default=None,
             help="stages of each prefill worker's pipeline (pd topology; default: "
                  "--pipeline-parallel-size)")
    add_flag(parser, "--decode-pipeline-parallel-size", type=int, default=None,
             help="stages of each decode worker's pipeline (pd topology; default: "
                  "--pipeline-parallel-size)")
    add_flag(parser, "--groups", type=int, default=1,
             help="scheduler groups (data parallel), each with its own scheduler and workers")
    add_flag(parser, "--gateways", type=int, default=1,
             help="gateway replicas; gateway i serves REST on --port + i, gRPC on --grpc-port + i")
    add_flag(parser, "--tokenizers", type=int, default=1, help="tokenizer replicas")
    # up's own: a local stack binds loopback, where a service alone binds every interface
    add_flag(parser, "--host", default="127.0.0.1", help="interface every service binds")
    add_flag(parser, "--base-port", type=int, default=50051,
             help="first of the internal gRPC ports, then the metrics ports")
    add_flag(parser, "--threads-per-worker", type=int, default=None,
             help="torch threads per worker (default: every core for up to two workers, "
                  "else the cores split between them)")
    add_flag(parser, "--tls", action="store_true", default=False,
             help="mutual TLS on every internal hop, with a throwaway CA and certificates made "
                  "at start (in <log-dir>/tls, else a temporary directory removed at exit)")
    add_flag(parser, "--tls-dir", default=None,
             help="mutual TLS with the certificates in this directory (`kvrelay certs "
                  "--out DIR` names them); made there if it has no ca.pem")
    add_flag(parser, "--log-dir", default=None,
             help="each service logs to <dir>/<name>.log (default: this terminal)")
    add_flag(parser, "--state-file", default=None,
             help=f"JSON with each service's pid, address and metrics URL "
                  f"(default: <log-dir>/{STATE_FILE_NAME} when --log-dir is set)")
    add_flag(parser, "--startup-timeout", type=float, default=600.0, help="seconds")
    add_flag(parser, "--stop-timeout", type=float, default=40.0,
             help="seconds for a graceful stop before stragglers are killed")
    add_flag(parser, "--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
             help="a crashed service is restarted with exponential backoff (1 s, 2 s, ... up "
                  "to 30 s) this many times in a row; a service that serves for 60 s has its "
                  "count reset; 0: a crash stops the whole stack")
    add_service_flags(parser)  # the services' own flags (passthrough.py)
    parser.set_defaults(env_names=list(flag_env_names(parser).values()))


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        say(problem)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    state_path = (Path(args.state_file) if args.state_file
                  else log_dir / STATE_FILE_NAME if log_dir else None)
    with _tls_directory(args, log_dir) as tls_dir:
        args.tls_dir = tls_dir
        crl = Path(tls_dir) / "crl.pem" if tls_dir else None
        args.tls_crl_file = str(crl) if crl and crl.exists() else None
        supervisor = Supervisor(plan_stack(args), args.topology, log_dir, state_path,
                                args.startup_timeout, args.stop_timeout, _child_env(args),
                                RestartPolicy(max_restarts=args.max_restarts))
        return supervisor.run()


@contextlib.contextmanager
def _tls_directory(args: argparse.Namespace, log_dir: Path | None):
    """The certificates directory (None: TLS off), its CA and certificates made if absent."""
    if not (args.tls or args.tls_dir):
        yield None
        return
    from kvrelay.common.certs import write_bundle
    if args.tls_dir or log_dir:
        directory = Path(args.tls_dir) if args.tls_dir else log_dir / "tls"
        if not (directory / "ca.pem").exists():
            write_bundle(directory)
        yield str(directory.resolve())
        return
    with tempfile.TemporaryDirectory(prefix="kvrelay-tls-") as temporary:
        write_bundle(temporary)
        yield temporary


def _check_args(args: argparse.Namespace) -> str | None:
    counts = (args.prefill_workers, args.decode_workers, args.num_workers, args.groups,
              args.gateways, args.tokenizers)
    if min(counts) < 1:
        return "worker, group, gateway and tokenizer counts must be >= 1"
    sizes = (args.tensor_parallel_size, args.prefill_tensor_parallel_size,
             args.decode_tensor_parallel_size, args.pipeline_parallel_size,
             args.prefill_pipeline_parallel_size, args.decode_pipeline_parallel_size)
    if min(size for size in sizes if size is not None) < 1:
        return "tensor- and pipeline-parallel sizes must be >= 1"
    problem = _check_nodes(args)
    if problem:
        return problem
    if args.max_restarts < 0:
        return "--max-restarts must be >= 0"
    internal = list(range(args.base_port, args.base_port + num_internal_ports(args)))
    public = public_ports(args)
    if len(set(public)) < len(public) or set(public) & set(internal):
        return (f"the gateways' ports (--port {args.port}, --grpc-port {args.grpc_port}, "
                f"{args.gateways} of each) must differ and lie outside the internal ports "
                f"{internal[0]}-{internal[-1]} (--base-port)")
    busy = busy_ports(args.host, [*public, *internal])
    if busy:
        return f"port(s) already in use on {args.host}: {', '.join(map(str, busy))}"
    return None


def _check_nodes(args: argparse.Namespace) -> str | None:
    """Where --nnodes > 1: one worker whose pipeline the hosts can split (worker flags too)."""
    if args.nnodes == 1 and args.dist_init_address is None:
        return None
    role = "both" if args.topology == "colocated" else "decode"
    one_decoder = args.num_workers if args.topology == "colocated" else args.decode_workers
    if args.nnodes > 1 and (one_decoder > 1 or args.groups > 1):
        return ("--nnodes > 1 spreads one worker's pipeline over several hosts (the colocated "
                "worker, or the pd topology's decode worker): one such worker, one group")
    try:
        NodePlacement(args.nnodes, 0, args.dist_init_address).check(
            pipeline_parallel_size(args, role), tensor_parallel_size(args, role))
    except ValueError as exc:
        return str(exc)
    return None


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in args.env_names}
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the files as they happen
    return env
