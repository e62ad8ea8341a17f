"""shared-prefix with prefix caching on and off, through the PD and colocated stacks, one run.

    python benchmarks/prefix_cache.py [--topologies pd,colocated]

Each stack is started by `kvrelay up` (with `--no-prefix-caching` for "off") and sent the
shared-prefix workload by `kvrelay bench serve` (64 requests at once, no warm-up: the first
requests must compute the shared system prompt). Reports TTFT and throughput from the bench
result and, from the scheduler's metrics, the prompt tokens the prefix cache served: as a share
of all prompt tokens looked up, and of the shared prompt tokens (the system prompt's full
blocks, once per request).
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
sys.path.insert(0, str(REPO))

from benchmarks.peers.kvrelay_stack import up_command  # noqa: E402
from services.bench.prompts import shared_prefix  # noqa: E402

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


def run_one(topology: str, caching: bool, workdir: Path, port: int, count: int) -> dict:
    log_dir = workdir / f"{topology}-{'on' if caching else 'off'}"
    log_dir.mkdir(parents=True)
    command = up_command(topology, port, log_dir, "bfloat16", None)
    if not caching:
        command.append("--no-prefix-caching")
    stack = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        state = _wait_ready(stack, log_dir / "state.json")
        rest_url = state["rest_url"]
        model = httpx.get(f"{rest_url}/v1/models", trust_env=False).json()["data"][0]["id"]
        scheduler = state["services"]["scheduler"]["metrics_url"]
        before = {name: counter_total(scheduler, f"kvrelay:prefix_cache_{name}_total")
                  for name in ("queries", "hits")}
        out = log_dir / "bench"
        subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve",
                        "--base-url", rest_url, "--workload", "shared-prefix", "--warmup", "0",
                        "--max-requests", str(count), "--out", str(out), "--quiet"],
                       check=True)
        after = {name: counter_total(scheduler, f"kvrelay:prefix_cache_{name}_total")
                 for name in ("queries", "hits")}
        shared = shared_prompt_tokens(rest_url, model)
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(120)
    summary = json.loads((out / "result.json").read_text())["runs"][0]["summary"]
    hits = after["hits"] - before["hits"]
    queries = after["queries"] - before["queries"]
    return {"topology": topology, "caching": caching, "ttft_p50_s": summary["ttft_s"]["p50"],
            "output_tok_s": summary["output_tokens_per_s"], "hits": hits, "queries": queries,
            "shared_tokens": shared * count,
            "hit_share_of_shared": hits / (shared * count) if shared else None}


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
    lines = ["| stack | prefix caching | TTFT p50 s | output tok/s | cache hits / prompt tokens "
             "looked up | hits / shared prompt tokens |", "|---|---|---|---|---|---|"]
    for row in rows:
        share = row["hit_share_of_shared"]
        lines.append(f"| {row['topology']} | {'on' if row['caching'] else 'off'} | "
                     f"{row['ttft_p50_s']:.2f} | {row['output_tok_s']:.1f} | "
                     f"{row['hits']:.0f} / {row['queries']:.0f} | "
                     f"{'-' if share is None else f'{share:.1%}'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="pd,colocated")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--port", type=int, default=28600)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-prefix-") as tmp:
        for index, topology in enumerate(args.topologies.split(",")):
            for offset, caching in enumerate((True, False)):
                port = args.port + 40 * (2 * index + offset)
                rows.append(run_one(topology, caching, Path(tmp), port, args.count))
                print(rows[-1], file=sys.stderr, flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
