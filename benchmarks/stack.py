"""chat-64 through the service stack (PD and colocated) beside the in-process engine, one run.

    python -m benchmarks.stack [--topologies pd,colocated] [--dtype auto] [--threads-per-worker 2]

A topology may carry environment variables for its stack's services after `@`, to compare
variants in one run: `--topologies pd,pd@KVRELAY_SHARED_COMPUTE_STEPS=overlap@OMP_WAIT_POLICY=PASSIVE`.

Each stack is started with `kvrelay up` (its service logs stay in `--log-dir`, default
bench-results/stack-<date>) and warmed up with one untimed pass of chat-64 drawn
with another seed, and so is the offline engine (in this process). Then come `--rounds` rounds:
in each, every system in turn gets the same 64 chat requests at once (streaming OpenAI requests
through `kvrelay bench serve`'s client: greedy, max_tokens 128, ignore_eos), the first system
rotating from round to round. Each round draws fresh prompts, so no prefix cache holds them.
The machine's speed drifts during a run, so "vs offline" is the median of per-round ratios.

Reports output tokens/s, TTFT and ITL, and the CPU time (from /proc) the gateway, tokenizer and
scheduler spent per output token; the workers' and the client's CPU is shown apart, and so are
the workers' steps and the seconds spent in them (`kvrelay:worker_step_seconds`): what is left
of the wall time went between steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

from benchmarks.offline import MAX_TOKENS, OfflineEngine
from benchmarks.summary import markdown_table, percentile
from benchmarks.workloads import chat64
from kvrelay.bench.client import ServerOptions
from kvrelay.bench.runner import Limits
from kvrelay.bench.runner import run as run_workload
from kvrelay.bench.workloads import chat_requests
from kvrelay.common.runtime import run_loop

FRONT_SERVICES = ("gateway", "tokenizer", "scheduler")
WARMUP_SEED = 1  # the timed pass uses chat64's default seed 0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class StackResult:
    system: str
    output_tokens: int
    wall_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    cpu_us_per_token: dict = field(default_factory=dict)
    other_cpu_us_per_token: dict = field(default_factory=dict)  # workers and the client
    # worker -> (steps, seconds in steps): the rest of the wall time is between steps
    worker_steps: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def parse_variant(variant: str) -> tuple[str, dict[str, str]]:
    """"pd@NAME=value@..." -> ("pd", {NAME: value, ...})."""
    topology, *assignments = variant.split("@")
    return topology, dict(assignment.split("=", 1) for assignment in assignments)


def start_stack(variant: str, args, workdir: Path, port: int) -> tuple[subprocess.Popen, dict]:
    topology, env_overrides = parse_variant(variant)
    name = f"{topology}-{port}"
    state_file = workdir / f"{name}.json"
    command = [sys.executable, "-m", "kvrelay.cli", "up", "--topology", topology,
               "--port", str(port), "--grpc-port", str(port + 1), "--base-port", str(port + 2),
               "--log-dir", str(workdir / name), "--state-file", str(state_file)]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if args.threads_per_worker:
        command += ["--threads-per-worker", str(args.threads_per_worker)]
    if args.kv_transport:
        command += ["--kv-transport", args.kv_transport]
    stack = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                             env={**os.environ, **env_overrides})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if stack.poll() is not None:
            raise SystemExit(f"kvrelay up ({variant}) exited with {stack.returncode}; "
                             f"logs in {workdir / name}")
        if state_file.exists():
            state = json.loads(state_file.read_text())
            if state["status"] == "ready":
                return stack, state
        time.sleep(1)
    stack.terminate()
    raise SystemExit(f"kvrelay up ({variant}) not ready after 600 s")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def step_totals(metrics_url: str) -> tuple[float, float]:
    """A worker's (steps run, seconds spent in them) so far, from its Prometheus endpoint."""
    text = httpx.get(metrics_url, timeout=10, trust_env=False).text
    totals = []
    for name in ("kvrelay:worker_step_seconds_count", "kvrelay:worker_step_seconds_sum"):
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        totals.append(float(match.group(1)) if match else 0.0)
    return totals[0], totals[1]


def drive(base_url: str, conversations) -> tuple[dict, float]:
    """Send every conversation at once through `kvrelay bench serve`'s client; the merged
    record and the wall time."""
    requests = chat_requests(conversations, MAX_TOKENS)
    options = ServerOptions(base_url, model=None)
    outcome = run_loop(run_workload(requests, options, Limits(time_limit_s=600)))
    failed = [r for r in outcome.records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    record = {"tokens": sum(r.output_tokens for r in outcome.records),
              "ttft": [r.ttft_s for r in outcome.records],
              "gaps": [gap for r in outcome.records for gap in r.itls_s]}
    return record, outcome.duration_s


class StackSystem:
    """One stack started by `kvrelay up` and warmed up, timed on as many passes as asked."""

    def __init__(self, variant: str, args, workdir: Path, port: int) -> None:
        self.name = f"kvrelay {variant.replace('@', ' ')} stack"
        self.process, self.state = start_stack(variant, args, workdir, port)
        self.pids = {name: info["pid"] for name, info in self.state["services"].items()}
        # A server runs for long: time the steady state, after one untimed pass of a workload
        # like this one (other prompts, so the prefix cache holds none of the timed ones).
        drive(self.state["rest_url"], chat64(seed=WARMUP_SEED))

    def run(self, conversations) -> StackResult:
        workers = {name: info["metrics_url"] for name, info in self.state["services"].items()
                   if info["kind"] == "worker"}
        steps_before = {name: step_totals(url) for name, url in workers.items()}
        before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        client_before = cpu_seconds(os.getpid())
        record, wall = drive(self.state["rest_url"], conversations)
        cpu = {name: cpu_seconds(pid) - before[name] for name, pid in self.pids.items()}
        client_cpu = cpu_seconds(os.getpid()) - client_before
        steps = {name: tuple(round(after - first, 2) for after, first in
                             zip(step_totals(url), steps_before[name]))
                 for name, url in workers.items()}
        tokens = record["tokens"]
        services = self.state["services"]
        front = {name: sec for name, sec in cpu.items() if services[name]["kind"] in FRONT_SERVICES}
        per_token = {name: round(sec / tokens * 1e6, 1) for name, sec in front.items()}
        per_token["total"] = round(sum(front.values()) / tokens * 1e6, 1)
        # Not front CPU, but where the rest of the machine went: the workers and this client.
        others = {name: sec for name, sec in cpu.items() if name not in front}
        others["client"] = client_cpu
        return StackResult(self.name, tokens, wall, percentile(record["ttft"], 50),
                           percentile(record["ttft"], 90),
                           _ms(percentile(record["gaps"], 50)),
                           _ms(percentile(record["gaps"], 90)), per_token,
                           {name: round(sec / tokens * 1e6) for name, sec in others.items()},
                           steps)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


class OfflineSystem:
    def __init__(self, dtype: str) -> None:
        self.engine = OfflineEngine(dtype, chat64(seed=WARMUP_SEED))
        self.name = None

    def run(self, conversations) -> StackResult:
        result = self.engine.run(conversations)
        self.name = f"kvrelay offline LLM ({result.dtype}, {result.threads} threads)"
        return StackResult(self.name, result.output_tokens, result.wall_s, result.ttft_p50_s,
                           result.ttft_p90_s, result.itl_p50_ms, result.itl_p90_ms)

    def stop(self) -> None:
        pass


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def markdown(rounds: list[list[StackResult]]) -> str:
    """Each system's median over the rounds; "vs offline" is the median of the per-round
    ratios (each round ran every system back to back, so a ratio shares the machine's phase)."""
    names = [result.system for result in rounds[0]]
    offline = next((name for name in names if name.startswith("kvrelay offline")), names[0])
    bases = [next(r for r in results if r.system == offline) for results in rounds]
    rows = [_system_row(name, [next(r for r in results if r.system == name)
                               for results in rounds], bases) for name in names]
    return markdown_table(["system", "output tok/s (median; each round)", "vs offline",
                           "TTFT p50 s", "ITL p50 ms", "ITL p90 ms",
                           "front CPU µs/token (gateway, tokenizer, scheduler)",
                           "workers and client CPU µs/token",
                           "worker steps: count, s in steps / wall s"], rows)


def _system_row(name: str, runs: list[StackResult], bases: list[StackResult]) -> list:
    ratios = [r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, bases)]
    middle = sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]
    each = ", ".join(f"{r.tokens_per_s:.0f}" for r in runs)
    cpu = ", ".join(f"{k} {v}" for k, v in middle.cpu_us_per_token.items()) or "-"
    other = ", ".join(f"{k} {v}" for k, v in middle.other_cpu_us_per_token.items()) or "-"
    steps = ", ".join(f"{k} {n:.0f}, {sec:.2f}" for k, (n, sec) in middle.worker_steps.items())
    steps = f"{steps} / {middle.wall_s:.2f}" if steps else "-"
    return [name, f"{middle.tokens_per_s:.1f} ({each})", f"{statistics.median(ratios):.2f}x",
            _f(middle.ttft_p50_s), _f(middle.itl_p50_ms), _f(middle.itl_p90_ms), cpu, other,
            steps]


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def round_seed(index: int) -> int:
    """Round 0 is the standard chat-64 (seed 0); later rounds draw fresh prompts, so no stack
    finds an earlier round's prompts in its prefix cache."""
    return 0 if index == 0 else 100 + index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="pd,colocated")
    parser.add_argument("--dtype", default=None, help="default: the stack's (auto)")
    parser.add_argument("--threads-per-worker", type=int, default=None)
    parser.add_argument("--kv-transport", default=None, choices=["grpc", "shm"])
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed passes per system, the systems taking turns")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where each stack's service logs stay after the run (default "
                             "bench-results/stack-<date>): a failed run is explained there")
    args = parser.parse_args()
    log_dir = args.log_dir or REPO / "bench-results" / time.strftime("stack-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    # a comma starts the next variant only before a topology's name: values may hold commas
    # (KVRELAY_PP_LAYER_PARTITION=13,17)
    variants = [t for t in re.split(r",(?=(?:pd|colocated)\b)", args.topologies) if t]
    systems = []
    rounds: list[list[StackResult]] = []
    print(f"service logs in {log_dir}", flush=True)
    try:
        for offset, variant in enumerate(variants):
            systems.append(StackSystem(variant, args, log_dir, args.port + 20 * offset))
        if not args.no_offline:
            systems.append(OfflineSystem(args.dtype or "auto"))
        for index in range(args.rounds):
            conversations = chat64(seed=round_seed(index))
            # Rotate who goes first, so no system always meets the same phase of a run.
            turn = systems[index % len(systems):] + systems[:index % len(systems)]
            results = {id(system): system.run(conversations) for system in turn}
            rounds.append([results[id(system)] for system in systems])
            print(f"round {index + 1}: " + ", ".join(
                f"{r.system} {r.tokens_per_s:.1f} tok/s" for r in rounds[-1]), flush=True)
    finally:
        for system in systems:
            system.stop()
    print(markdown(rounds))
    if args.json:
        args.json.write_text(json.dumps(
            [[asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]
             for results in rounds], indent=2))


if __name__ == "__main__":
    main()
