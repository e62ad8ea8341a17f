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
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.stack.plan import TOPOLOGIES, num_internal_ports, plan_stack, public_ports
from kvrelay.stack.ports import busy_ports
from kvrelay.stack.restarts import DEFAULT_MAX_RESTARTS, RestartPolicy
from kvrelay.stack.supervisor import Supervisor, say

STATE_FILE_NAME = "stack.json"


def _checked_speculative_config(text: str) -> str:
    """Refused here, before any child starts, rather than by the scheduler's child."""
    try:
        SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--topology", choices=TOPOLOGIES, default="pd",
             help="pd: prefill + decode workers; colocated: --role both workers")
    add_flag(parser, "--prefill-workers", "--num-prefill-workers", type=int, default=1,
             help="prefill workers per group (pd topology)")
    add_flag(parser, "--decode-workers", "--num-decode-workers", type=int, default=1,
             help="decode workers per group (pd topology)")
    add_flag(parser, "--num-workers", type=int, default=1,
             help="--role both workers per group (colocated topology)")
    add_flag(parser, "--groups", type=int, default=1,
             help="scheduler groups (data parallel), each with its own scheduler and workers")
    add_flag(parser, "--gateways", type=int, default=1,
             help="gateway replicas; gateway i serves REST on --port + i, gRPC on --grpc-port + i")
    add_flag(parser, "--tokenizers", type=int, default=1, help="tokenizer replicas")
    add_flag(parser, "--host", default="127.0.0.1", help="interface every service binds")
    add_flag(parser, "--port", type=int, default=8000, help="the gateway's OpenAI REST port")
    add_flag(parser, "--grpc-port", type=int, default=50050, help="the gateway's public gRPC port")
    add_flag(parser, "--base-port", type=int, default=50051,
             help="first of the internal gRPC ports, then the metrics ports")
    add_flag(parser, "--model", default=None, help="model for tokenizer and workers")
    add_flag(parser, "--chat-template", default=None,
             help="a Jinja chat template file for the tokenizers, instead of the model's own "
                  "(`kvrelay tokenizer --help`)")
    add_flag(parser, "--served-model-name", default=None, help="model id the API shows")
    add_flag(parser, "--dtype", choices=("auto", "float32", "bfloat16"), default=None)
    add_flag(parser, "--kv-cache-memory", type=int, default=None, help="bytes per worker")
    add_flag(parser, "--num-kv-blocks", type=int, default=None, help="per worker")
    add_flag(parser, "--int4-max-tokens", type=int, default=None,
             help="workers' steps of at most this many tokens use the checkpoint's 4-bit "
                  "weights (default: the worker's, 4; 0: never)")
    add_flag(parser, "--amx-max-tokens", type=int, default=None,
             help="workers' steps up to this many tokens run on AMX tiles (default: the "
                  "worker's, 32; 0: never)")
    add_flag(parser, "--q4a8-max-tokens", type=int, default=None,
             help="workers' steps up to this many tokens on the VNNI kernel where the CPU has "
                  "AVX512-VNNI (default: the worker's, 11; 0: never)")
    add_flag(parser, "--int8-activations", action="store_true", default=False,
             help="workers run every layer step on the VNNI kernel with int8 activations "
                  "(faster, less accurate)")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=None)
    add_flag(parser, "--prefill-max-num-batched-tokens", type=int, default=None,
             help="a prefill worker's step budget (default: the scheduler's, "
                  "--max-num-batched-tokens)")
    add_flag(parser, "--no-prefix-caching", action="store_true", default=False)
    add_flag(parser, "--no-async-scheduling", action="store_true", default=False,
             help="the scheduler plans each step after the previous one's result "
                  "(`kvrelay scheduler --help`)")
    add_flag(parser, "--kv-transport", choices=("grpc", "shm"), default=None)
    add_flag(parser, "--shared-compute-steps", choices=("serialize", "split", "overlap"),
             default=None, help="how workers on the same cores step: serialize, split "
                                "(the scheduler's default) or overlap (`kvrelay scheduler --help`)")
    add_flag(parser, "--structured-outputs-backend", choices=("llguidance", "xgrammar"),
             default=None, help="grammar backend for structured output (default: llguidance)")
    add_flag(parser, "--speculative-config", type=_checked_speculative_config, default=None,
             help="speculative decoding, as vLLM takes it (JSON; `kvrelay scheduler --help`)")
    add_flag(parser, "--max-queued-requests", type=int, default=None,
             help="requests waiting for a first step before new ones get 503 with Retry-After "
                  "(default: the scheduler's, 1024; 0: no limit)")
    add_flag(parser, "--request-timeout", type=float, default=None,
             help="the gateways' per-request deadline in seconds (default: none)")
    add_flag(parser, "--tokenizer-wait-timeout", type=float, default=None,
             help="seconds the gateways' requests in flight wait for a lost tokenizer to come "
                  "back (default: the gateway's, 30)")
    add_flag(parser, "--worker-wait-timeout", type=float, default=None,
             help="seconds a request whose worker died waits for a live one (default: the "
                  "scheduler's, 60)")
    add_flag(parser, "--threads-per-worker", type=int, default=None,
             help="torch threads per worker (default: every core for up to two workers, "
                  "else the cores split between them)")
    add_flag(parser, "--api-key", default=None, help="required bearer token for the API")
    add_flag(parser, "--tls", action="store_true", default=False,
             help="mutual TLS on every internal hop, with a throwaway CA and certificates made "
                  "at start (in <log-dir>/tls, else a temporary directory removed at exit)")
    add_flag(parser, "--tls-dir", default=None,
             help="mutual TLS with the certificates in this directory (`kvrelay certs "
                  "--out DIR` names them); made there if it has no ca.pem")
    add_flag(parser, "--log-level", default="info")
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


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in args.env_names}
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the files as they happen
    return env
