"""shared-prefix with prefix caching on and off, through the PD and colocated stacks, one run.

    python -m benchmarks.prefix_cache [--topologies pd,colocated] [--rounds 1]
    python -m benchmarks.prefix_cache --topologies pd --no-off --rounds 2 --checkouts .,/tmp/old

Each stack is started by `kvrelay up` (with `--no-prefix-caching` for "off") and sent the
shared-prefix workload by `kvrelay bench serve` (64 requests at once, no warm-up: the first
requests must compute the shared system prompt). Reports TTFT and throughput from the bench
result and, from the scheduler's metrics, the prompt tokens the prefix cache served: as a share
of all prompt tokens looked up, and of the shared prompt tokens (the system prompt's full
blocks, once per request). For PD also the KV bytes the prefill workers pushed and the shared
prompt tokens no transfer had to push (the decode worker held them, or another send of the same
step pushed them).

`--checkouts` runs the stacks from other source trees too (e.g. a `git worktree` of an older
commit), the variants taking turns in each of `--rounds` rounds: a before/after on one machine
state. Each other tree runs on its own `.venv` (`make venv` there), whose kvrelay is installed
from that tree; trees from before the `kvrelay` package (commit 1a9a61d) cannot be run this way.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

from benchmarks.peers.kvrelay_stack import up_command
from benchmarks.summary import markdown_table
from kvrelay.bench.prompts import shared_prefix

BLOCK_SIZE = 16


def counter_total(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10, trust_env=False).text
    return sum(float(value) for value in
               re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def shared_prompt_tokens(rest_url: str, model: str) -> int:
    """Tokens in the full blocks that every request's rendered prompt shares."""
    prompts = []
    for conversation in shared_prefix()[:2]:
        reply = httpx.post(f"{rest_url}/tokenize", json={"model": model,
                                                         "messages": conversation},
                           timeout=30, trust_env=False).json()
        prompts.append(reply["tokens"])
    common = 0
    while common < min(map(len, prompts)) and prompts[0][common] == prompts[1][common]:
        common += 1
    return common // BLOCK_SIZE * BLOCK_SIZE


def checkout_python(checkout: Path) -> str:
    """The interpreter whose kvrelay is that tree's code: ours for this repository, the tree's
    own .venv for another (kvrelay is an installed package, so the working directory alone
    would run this venv's kvrelay)."""
    if checkout == REPO:
        return sys.executable
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{checkout}: no .venv/bin/python (run `make venv` there)")
    return str(python)


def run_one(topology: str, caching: bool, checkout: Path, workdir: Path, port: int,
            count: int) -> dict:
    name = f"{topology}-{'on' if caching else 'off'}-{port}"
    log_dir = workdir / name
    log_dir.mkdir(parents=True)
    command = up_command(topology, port, log_dir, "bfloat16", None)
    if not caching:
        command.append("--no-prefix-caching")
    command[0] = checkout_python(checkout)
    stack = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             cwd=checkout)
    try:
        state = _wait_ready(stack, log_dir / "state.json")
        rest_url = state["rest_url"]
        model = httpx.get(f"{rest_url}/v1/models", trust_env=False).json()["data"][0]["id"]
        before, after = _counters(state), None
        out = log_dir / "bench"
        subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "serve",
                        "--base-url", rest_url, "--workload", "shared-prefix", "--warmup", "0",
                        "--max-requests", str(count), "--out", str(out), "--quiet"],
                       check=True, cwd=REPO)
        after = _counters(state)
        shared = shared_prompt_tokens(rest_url, model)
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(120)
    summary = json.loads((out / "result.json").read_text())["runs"][0]["summary"]
    delta = {name: after[name] - before[name] for name in after}
    return {"topology": topology, "caching": caching, "checkout": str(checkout),
            "ttft_p50_s": summary["ttft_s"]["p50"], "e2e_p90_s": summary["e2e_s"]["p90"],
            "output_tok_s": summary["output_tokens_per_s"], **delta,
            "shared_tokens": shared * count,
            "hit_share_of_shared": delta["hits"] / (shared * count) if shared else None}


def _counters(state: dict) -> dict[str, float]:
    """The scheduler's prefix-cache counters and the decode side's held tokens; the KV bytes
    the prefill workers pushed."""
    services = state["services"]
    scheduler = services["scheduler"]["metrics_url"]
    counters = {name: counter_total(scheduler, f"kvrelay:prefix_cache_{name}_total")
                for name in ("queries", "hits")}
    counters["not_pushed"] = counter_total(
        scheduler, "kvrelay:kv_transfer_shared_prefix_tokens_total")
    counters["pushed_bytes"] = sum(
        counter_total(service["metrics_url"], "kvrelay:kv_transfer_bytes_total")
        for service in services.values() if service["role"] == "prefill")
    return counters


def _wait_ready(stack: subprocess.Popen, state_file: Path, timeout_s: float = 600) -> dict:
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stack.poll() is not None:
            raise SystemExit(f"kvrelay up exited with {stack.returncode}")
        if state_file.exists():
            state = json.loads(state_file.read_text())
            if state["status"] == "ready":
                return state
        time.sleep(1)
    raise SystemExit("kvrelay up not ready in time")


def markdown(rows: list[dict]) -> str:
    table = []
    for row in rows:
        share = row["hit_share_of_shared"]
        table.append([row["topology"], row["checkout"], "on" if row["caching"] else "off",
                      f"{row['ttft_p50_s']:.2f}", f"{row['e2e_p90_s']:.2f}",
                      f"{row['output_tok_s']:.1f}", f"{row['hits']:.0f} / {row['queries']:.0f}",
                      "-" if share is None else f"{share:.1%}",
                      f"{row['pushed_bytes'] / 1e9:.2f}", f"{row['not_pushed']:.0f}"])
    return markdown_table(["stack", "code", "prefix caching", "TTFT p50 s", "e2e p90 s",
                           "output tok/s", "cache hits / prompt tokens looked up",
                           "hits / shared prompt tokens", "KV pushed GB",
                           "shared prefix tokens not pushed"], table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="pd,colocated")
    parser.add_argument("--checkouts", default=str(REPO),
                        help="comma-separated source trees to run the stacks from")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-off", action="store_true", help="prefix caching on only")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--port", type=int, default=28600)
    args = parser.parse_args()
    variants = [(topology, caching, Path(checkout).resolve())
                for topology in args.topologies.split(",")
                for caching in ((True,) if args.no_off else (True, False))
                for checkout in args.checkouts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-prefix-") as tmp:
        for round_index in range(args.rounds):
            for index, (topology, caching, checkout) in enumerate(variants):
                port = args.port + 40 * (index + len(variants) * round_index)
                rows.append(run_one(topology, caching, checkout, Path(tmp), port, args.count))
                print(rows[-1], file=sys.stderr, flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
