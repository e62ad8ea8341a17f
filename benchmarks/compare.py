"""The side-by-side comparison in one command: kvrelay PD, kvrelay colocated and each peer, one
after another, on the same workloads, then BENCHMARKS.md's marked section is rewritten.

    .venv/bin/python -m benchmarks.compare                     # everything (~50 min on 2 cores)
    .venv/bin/python -m benchmarks.compare --systems kvrelay-pd,llama-server --workloads chat-64
    .venv/bin/python -m benchmarks.compare --max-requests 4 --max-tokens 8   # a quick look

A partial run (--max-requests or --max-tokens) never touches BENCHMARKS.md.

Each server is started on free local ports (`kvrelay up`; llama-server and `transformers serve`
from their own venvs, installed on first use by benchmarks/peers/), warmed up, measured with
`kvrelay bench serve` on every workload, and stopped before the next starts, so no two systems
share the cores. HF static batching has no server: it runs chat-64 in the transformers venv.
A system that fails to start or to run is recorded with its error, and the run goes on.
A kvrelay system may carry `kvrelay up` flags after `@`, and vLLM `vllm serve` flags, to
compare variants in one run: `--systems kvrelay-pd,kvrelay-pd@kv-cache-dtype=int8,
vllm-cpu,vllm-cpu@kv-cache-dtype=fp8`.

Another model: `--model DIR` (a Hugging Face directory) is served by every system from that
directory (`kvrelay up --model DIR`, `vllm serve DIR`, ...; llama-server serves only its own
GGUF of the default model, so it is refused); `--family NAME` does the same on a random
checkpoint of that family with the default model's dimensions, written once under
--checkpoints (benchmarks/family_checkpoints.py). Such a run never touches BENCHMARKS.md's
marked section, which is the default model's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from benchmarks import family_checkpoints, kv_capacity
from benchmarks.memory import tree_memory
from benchmarks import compare_report
from benchmarks.peers import hf_transformers, kvrelay_stack, llama_server, vllm_cpu
from benchmarks.peers.common import Server, log_tail, stop

SERVER_SYSTEMS = ("kvrelay-pd", "kvrelay-colocated", "vllm-cpu", "llama-server",
                  "transformers-serve")
ALL_SYSTEMS = SERVER_SYSTEMS + ("hf-static",)
WORKLOADS = ("chat-64", "single-stream", "poisson", "shared-prefix", "long+short",
             "chat-64-json", "grounded", "grounded-single")
# On demand: chat-64-json (every request under a JSON schema), grounded (passages to copy or
# quote, 8 at a time) and grounded-single (the same, one at a time): speculative decoding's.
DEFAULT_WORKLOADS = WORKLOADS[:5]
# single-stream: chat-64's first prompts one at a time, as one user typing at a chat would
SINGLE_STREAM_REQUESTS = 8
GROUNDED_CONCURRENCY = 8
GROUNDED_REQUESTS = 16
DEFAULT_SPECULATIVE_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 4, '
                              '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')


# Systems that cannot serve another model's directory (llama-server runs its own Q4_0 GGUF).
DEFAULT_MODEL_ONLY = ("llama-server",)
DEFAULT_CHECKPOINTS = REPO / "bench-results" / "checkpoints"


# compare's workloads that are `bench serve` workloads under another concurrency
BENCH_WORKLOAD = {"single-stream": "chat-64", "grounded-single": "grounded"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=None,
                        help="default: every system (with --model or --family, every one "
                             "that serves another model)")
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    parser.add_argument("--rates", default="0.5,1,2,4", help="the poisson sweep, requests/s")
    parser.add_argument("--poisson-requests", type=int, default=None,
                        help="requests per poisson rate (default: the workload's 64)")
    parser.add_argument("--long-short-rate", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16",
                        help="kvrelay, vLLM and HF transformers (llama-server runs its own "
                             "Q4_0 GGUF: benchmarks/peers/llama_server.py)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-parallel", type=int, default=16)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=64,
                        help="untimed requests to each server first")
    parser.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE_CONFIG,
                        help="what a system named with a +spec suffix (kvrelay-pd+spec, "
                             "vllm-cpu+spec) is started with")
    parser.add_argument("--max-requests", type=int, default=None, help="per run (a quick look)")
    parser.add_argument("--max-tokens", type=int, default=None, help="override 128")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.1)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--home", default=None, help="where peers are installed "
                        "(default ~/.cache/kvrelay-peers or KVRELAY_PEERS_HOME)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench-results/compare-<date>")
    parser.add_argument("--benchmarks-md", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-update", action="store_true", help="leave BENCHMARKS.md alone")
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face model directory every system serves (default: "
                             "the default model)")
    parser.add_argument("--family", choices=family_checkpoints.FAMILIES, default=None,
                        help="serve a random checkpoint of this family with the default "
                             "model's dimensions (written once under --checkpoints)")
    parser.add_argument("--checkpoints", type=Path, default=DEFAULT_CHECKPOINTS,
                        help="where --family's checkpoints are kept")
    parser.add_argument("--report-from", type=Path, default=None,
                        help="no new runs: report what the run that wrote this --out folder "
                             "left there (also a run stopped part way)")
    args = parser.parse_args(argv)
    other_model = args.model or args.family
    servable = [s for s in ALL_SYSTEMS if not (other_model and s in DEFAULT_MODEL_ONLY)]
    args.systems = ([s for s in args.systems.split(",") if s] if args.systems is not None
                    else servable)
    args.workloads = [w for w in args.workloads.split(",") if w]
    bases = {system_variant(s)[0].removesuffix("+spec") for s in args.systems}
    unknown = bases - set(ALL_SYSTEMS) | set(args.workloads) - set(WORKLOADS)
    if any("@" in s and not s.startswith(("kvrelay-", "vllm-cpu")) for s in args.systems):
        parser.error("only kvrelay and vLLM systems take flags after @")
    if unknown:
        parser.error(f"unknown system or workload: {', '.join(sorted(unknown))}")
    if args.model and args.family:
        parser.error("--model and --family are two ways to name the model: give one")
    if other_model and bases & set(DEFAULT_MODEL_ONLY):
        parser.error(f"{', '.join(sorted(bases & set(DEFAULT_MODEL_ONLY)))} serves only the "
                     "default model; leave it out of a --model or --family run")
    args.out = (args.report_from or args.out
                or REPO / "bench-results" / time.strftime("compare-%Y%m%d-%H%M%S"))
    return args


def system_variant(name: str) -> tuple[str, list[str]]:
    """"kvrelay-pd@flag=value@..." -> ("kvrelay-pd", ["--flag", "value", ...])."""
    base, *assignments = name.split("@")
    flags = []
    for assignment in assignments:
        flag, _, value = assignment.partition("=")
        flags += [f"--{flag}", value] if value else [f"--{flag}"]
    return base, flags


def free_port_block(size: int = 40, start: int = 28400) -> int:
    """The first port of `size` consecutive free ones (kvrelay up needs a block); from 28400,
    clear of benchmarks/stack.py's 18400-18460, which may be running at the same time."""
    for first in range(start, 60000, size):
        if all(_is_free(port) for port in range(first, first + size)):
            return first
    raise RuntimeError("no block of free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def launch(name: str, args, port: int, log_dir: Path) -> Server:
    base, up_flags = system_variant(name)
    if base.endswith("+spec"):
        base = base.removesuffix("+spec")
        up_flags = [*up_flags, "--speculative-config", args.speculative_config]
    if base in ("kvrelay-pd", "kvrelay-colocated"):
        return kvrelay_stack.launch(base.removeprefix("kvrelay-"), port, log_dir, args.dtype,
                                    args.threads, args.startup_timeout, up_flags, args.model)
    if base == "llama-server":
        return llama_server.launch(port, log_dir / "server.log", args.home,
                                   args.llama_parallel, args.threads, args.startup_timeout)
    if base == "vllm-cpu":
        return vllm_cpu.launch(port, log_dir / "server.log", args.home, args.dtype,
                               args.threads, args.startup_timeout, up_flags, args.model)
    return hf_transformers.launch_serve(port, log_dir / "server.log", args.home, args.dtype,
                                        args.threads, args.startup_timeout, args.model)


def bench_command(server: Server, workload: str, args, out: Path, warmup: int) -> list[str]:
    command = [sys.executable, "-m", "kvrelay.cli", "bench", "serve",
               "--base-url", server.base_url, "--backend", server.backend,
               "--workload", BENCH_WORKLOAD.get(workload, workload),
               "--seed", str(args.seed), "--label", server.name,
               "--time-limit", str(args.time_limit), "--slo-ttft", str(args.slo_ttft),
               "--slo-tpot", str(args.slo_tpot), "--warmup", str(warmup), "--out", str(out)]
    for url in server.metrics_urls:
        command += ["--metrics-url", url]
    if workload == "poisson":
        command += ["--rates", args.rates]
        if args.poisson_requests:
            command += ["--num-requests", str(args.poisson_requests)]
    if workload == "long+short":
        command += ["--rate", str(args.long_short_rate)]
    max_requests = args.max_requests
    if workload == "single-stream":
        command += ["--max-concurrency", "1"]
        max_requests = min(max_requests or SINGLE_STREAM_REQUESTS, SINGLE_STREAM_REQUESTS)
    if workload == "grounded":
        command += ["--max-concurrency", str(GROUNDED_CONCURRENCY)]
        max_requests = min(max_requests or GROUNDED_REQUESTS, GROUNDED_REQUESTS)
    if workload == "grounded-single":
        command += ["--max-concurrency", "1"]
        max_requests = min(max_requests or SINGLE_STREAM_REQUESTS, SINGLE_STREAM_REQUESTS)
    for flag, value in (("--max-requests", max_requests),
                        ("--max-tokens", args.max_tokens)):
        if value:
            command += [flag, str(value)]
    return command


def run_server_system(name: str, args, by_workload: dict, run_errors: list) -> dict:
    log_dir = args.out / name
    print(f"\n=== {name} ===", file=sys.stderr, flush=True)
    try:
        server = launch(name, args, free_port_block(), log_dir)
    except Exception as exc:  # noqa: BLE001 - any failure to start is recorded, not fatal
        print(f"{name} did not start: {exc}", file=sys.stderr)
        return {"name": name, "error": f"failed to start: {exc}"}
    try:
        for index, workload in enumerate(args.workloads):
            # Warm up once per server (first workload): kernels for every batch shape, with
            # prompts of another seed so no timed prompt sits in a prefix cache.
            out = log_dir / workload
            command = bench_command(server, workload, args, out,
                                    args.warmup if index == 0 else 0)
            done = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            result_path = out / "result.json"
            if done.returncode == 0 and result_path.exists():
                by_workload[workload].append((server.name, json.loads(result_path.read_text())))
            else:
                run_errors.append((server.name, workload,
                                   f"bench serve exited {done.returncode}"))
            if server.process.poll() is not None:
                raise RuntimeError(f"the server died (exit {server.process.returncode})")
    except Exception as exc:  # noqa: BLE001
        run_errors.append((server.name, "-", f"{exc} {log_tail(log_dir / 'server.log', 3)}"))
    finally:
        memory = tree_memory(server.process.pid)  # still up: every process's peak so far
        kv_tokens = _kv_capacity(server)
        stop(server.process, grace_s=60)
    return {"name": server.name, "info": server.info, "command": server.command,
            "memory": memory, "kv_capacity_tokens": kv_tokens}


def _kv_capacity(server) -> int | None:
    try:
        return kv_capacity.read(server.base_url, server.metrics_urls)
    except Exception as exc:  # noqa: BLE001 - a number for the report, never a failed run
        print(f"{server.name}: KV capacity not read ({exc})", file=sys.stderr)
        return None


def run_hf_static(args) -> tuple[dict, dict | None]:
    print("\n=== hf-static ===", file=sys.stderr, flush=True)
    out = args.out / "hf-static" / "result.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        python = hf_transformers.install(args.home)
        command = hf_transformers.static_command(python, args.dtype, args.threads,
                                                 args.hf_batch_size, out, args.max_requests,
                                                 args.max_tokens or 128, args.model)
        subprocess.run(command, check=True, timeout=args.time_limit * 4,
                       env={**os.environ, **hf_transformers.offline_env(args.threads)})
        result = json.loads(out.read_text())
    except Exception as exc:  # noqa: BLE001
        return {"name": "HF static batching", "error": f"failed: {exc}"}, None
    system = {"name": result["system"], "command": command,
              "info": {"version": result["versions"], "dtype": result["dtype"],
                       "threads": result["threads"]}}
    return system, result


def _summaries(result: dict) -> list[dict]:
    # Per-request timings stay in each run's own result.json.
    return [{k: v for k, v in run.items() if k != "requests"} for run in result["runs"]]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} cores of {model}"


def run_all(args, meta: dict) -> tuple[list, dict, list]:
    """Every system on every workload; what finished is also kept in args.out as it comes
    (meta.json, systems.json, each run's result.json), so a stopped run can be reported."""
    by_workload = {workload: [] for workload in args.workloads}
    systems, static = [], []
    for name in args.systems:
        if name == "hf-static":
            if "chat-64" not in args.workloads:
                continue
            system, result = run_hf_static(args)
            systems.append(system | {"dir": "hf-static"})
            static += [result] if result else []
        else:
            system = run_server_system(name, args, by_workload, meta["run_errors"])
            systems.append(system | {"dir": name})
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        (args.out / "systems.json").write_text(json.dumps(systems, indent=1, default=str))
    return systems, by_workload, static


def load_run(out: Path, workloads: list[str]) -> tuple[dict, list, dict, list]:
    """What a (possibly stopped) run left in `out`: its meta, its systems and their results."""
    meta = json.loads((out / "meta.json").read_text())
    systems = json.loads((out / "systems.json").read_text())
    by_workload = {workload: [] for workload in workloads}
    static = []
    for system in systems:
        if system["dir"] == "hf-static":
            path = out / "hf-static" / "result.json"
            static += [json.loads(path.read_text())] if path.exists() else []
            continue
        for workload in workloads:
            path = out / system["dir"] / workload / "result.json"
            if path.exists():
                by_workload[workload].append((system["name"], json.loads(path.read_text())))
    return meta, systems, by_workload, static


def resolve_model(args) -> Path | None:
    """The directory every system serves: --model's, or --family's checkpoint (written on
    first use); None for the default model."""
    if args.family:
        return family_checkpoints.ensure_checkpoint(args.family,
                                                    args.checkpoints / args.family).resolve()
    return args.model.resolve() if args.model else None


def model_description(model: Path) -> str:
    """What the report says was served: the directory and its architecture."""
    architectures = json.loads((model / "config.json").read_text()).get("architectures") or []
    return f"{model} ({', '.join(architectures) or 'no architectures in config.json'})"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_from:
        args.model = resolve_model(args)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "seed": args.seed,
            **({"model": model_description(args.model)} if args.model else {}),
            "command": shlex.join([".venv/bin/python", "-m", "benchmarks.compare"]
                                  + (sys.argv[1:] if argv is None else list(argv))),
            "warmup": args.warmup, "slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot,
            "run_errors": []}
    if args.report_from:
        meta, systems, by_workload, static = load_run(args.report_from, args.workloads)
    else:
        systems, by_workload, static = run_all(args, meta)
    body = compare_report.section(meta, systems, by_workload, static)
    (args.out / "comparison.md").write_text(body)
    (args.out / "comparison.json").write_text(json.dumps(
        {"meta": meta, "systems": systems, "static": static,
         "results": {w: [(s, _summaries(r)) for s, r in rs] for w, rs in by_workload.items()}},
        indent=1, default=str))
    print(body)
    if args.max_requests or args.max_tokens:
        print("a partial run (--max-requests / --max-tokens): BENCHMARKS.md left alone",
              file=sys.stderr)
    elif args.model or args.family:
        print("another model than the default (--model / --family): BENCHMARKS.md left alone",
              file=sys.stderr)
    elif not args.no_update:
        document = args.benchmarks_md.read_text()
        args.benchmarks_md.write_text(compare_report.refresh_section(document, body))
        print(f"updated {args.benchmarks_md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
