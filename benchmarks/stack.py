"""chat-64 through the service stack (PD and colocated) beside the in-process engine, one run.

    python benchmarks/stack.py [--topologies pd,colocated] [--dtype auto] [--threads-per-worker 2]

A topology may carry environment variables for its stack's services after `@`, to compare
variants in one run: `--topologies pd,pd@KVRELAY_SHARED_COMPUTE_STEPS=overlap@OMP_WAIT_POLICY=PASSIVE`.

Each stack is started with `kvrelay up`, warmed up with one untimed pass of chat-64 drawn with
another seed (the offline engine too), then sent the 64 chat requests at once as
streaming OpenAI requests (greedy, max_tokens 128, ignore_eos). Reports output tokens/s, TTFT
and ITL, and the CPU time the gateway, tokenizer and scheduler processes spent per output token
(from /proc, so the client's own CPU is not counted; it and the workers' are printed
apart). The client is `kvrelay bench serve`'s (aiohttp on uvloop). The offline engine runs
last, alone.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline import MAX_TOKENS, _pct, run_kvrelay  # noqa: E402
from benchmarks.workloads import chat64  # noqa: E402
from services.bench.client import ServerOptions  # noqa: E402
from services.bench.runner import Limits  # noqa: E402
from services.bench.runner import run as run_workload  # noqa: E402
from services.bench.workloads import chat_requests  # noqa: E402
from services.common.runtime import run_loop  # noqa: E402

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
    command = [sys.executable, "-m", "services.cli", "up", "--topology", topology,
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


def run_stack(topology: str, args, workdir: Path, port: int, conversations) -> StackResult:
    stack, state = start_stack(topology, args, workdir, port)
    try:
        pids = {name: info["pid"] for name, info in state["services"].items()}
        # A server runs for long: time the steady state, after one untimed pass of a workload
        # like this one (other prompts, so the prefix cache holds none of the timed ones).
        drive(state["rest_url"], chat64(seed=WARMUP_SEED))
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client_before = cpu_seconds(os.getpid())
        record, wall = drive(state["rest_url"], conversations)
        cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        client_cpu = cpu_seconds(os.getpid()) - client_before
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=120)
    tokens = record["tokens"]
    front = {name: seconds for name, seconds in cpu.items()
             if state["services"][name]["kind"] in FRONT_SERVICES}
    per_token = {name: round(seconds / tokens * 1e6, 1) for name, seconds in front.items()}
    per_token["total"] = round(sum(front.values()) / tokens * 1e6, 1)
    # Not front CPU, but where the rest of the machine went: the workers and this client.
    others = {name: seconds for name, seconds in cpu.items() if name not in front}
    others["client"] = client_cpu
    print("other CPU µs/token: " + ", ".join(f"{name} {seconds / tokens * 1e6:.0f}"
                                             for name, seconds in others.items()), flush=True)
    return StackResult(f"kvrelay {topology.replace('@', ' ')} stack", tokens, wall, _pct(record["ttft"], 0.5),
                       _pct(record["ttft"], 0.9), _ms(_pct(record["gaps"], 0.5)),
                       _ms(_pct(record["gaps"], 0.9)), per_token)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def markdown(results: list[StackResult], offline_tps: float) -> str:
    lines = ["| system | output tok/s | vs offline | wall s | TTFT p50 s | TTFT p90 s | "
             "ITL p50 ms | ITL p90 ms | front CPU µs/token (gateway, tokenizer, scheduler) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cpu = ", ".join(f"{k} {v}" for k, v in r.cpu_us_per_token.items()) or "-"
        lines.append(f"| {r.system} | {r.tokens_per_s:.1f} | {r.tokens_per_s / offline_tps:.2f}x "
                     f"| {r.wall_s:.1f} | {_f(r.ttft_p50_s)} | {_f(r.ttft_p90_s)} | "
                     f"{_f(r.itl_p50_ms)} | {_f(r.itl_p90_ms)} | {cpu} |")
    return "\n".join(lines)


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="pd,colocated")
    parser.add_argument("--dtype", default=None, help="default: the stack's (auto)")
    parser.add_argument("--threads-per-worker", type=int, default=None)
    parser.add_argument("--kv-transport", default=None, choices=["grpc", "shm"])
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    conversations = chat64()
    results = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp:
        for offset, topology in enumerate(t for t in args.topologies.split(",") if t):
            result = run_stack(topology, args, Path(tmp), args.port + 20 * offset, conversations)
            print(f"{result.system}: {result.tokens_per_s:.1f} tok/s", flush=True)
            results.append(result)
    offline_tps = 0.0
    if not args.no_offline:
        offline = run_kvrelay(conversations, args.dtype or "auto",
                              warmup_conversations=chat64(seed=WARMUP_SEED))
        offline_tps = offline.tokens_per_s
        results.append(StackResult(
            f"kvrelay offline LLM ({offline.dtype}, {offline.threads} threads)",
            offline.output_tokens, offline.wall_s, offline.ttft_p50_s, offline.ttft_p90_s,
            offline.itl_p50_ms, offline.itl_p90_ms))
    print(markdown(results, offline_tps or results[0].tokens_per_s))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"tokens_per_s": r.tokens_per_s}
                                         for r in results], indent=2))


if __name__ == "__main__":
    main()
