"""`kvrelay bench serve`: drive any OpenAI-compatible server with a standard workload.

    kvrelay bench serve --base-url http://127.0.0.1:8000 --workload chat-64
    kvrelay bench serve --base-url URL --workload poisson --rates 1,2,4,8 --out results/
    kvrelay bench serve --base-url URL --workload long+short     # with and without the long ones
    kvrelay bench serve --base-url URL --workload jsonl --jsonl prompts.jsonl --max-requests 100

Writes result.json (summaries and every request's timings), results.md (the table) and PNG plots
(latency CDFs; throughput and goodput against rate for a sweep) into --out, prints the table,
and shows a progress line on stderr. Only --base-url is ever contacted.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvrelay.bench import report, spec_metrics, workloads
from kvrelay.bench.outputs import command_line, write_outputs
from kvrelay.bench.client import BACKENDS, ServerOptions, discover_model
from kvrelay.bench.metrics import Slo, max_rate_meeting, summarize
from kvrelay.bench.progress import Progress
from kvrelay.bench.runner import Limits, RunResult, make_client
from kvrelay.bench.runner import run as run_workload
from kvrelay.common.runtime import run_loop


@dataclass(slots=True)
class PlannedRun:
    label: str
    requests: list[workloads.BenchRequest]
    rate: float | None = None
    phase: str | None = None  # long+short: "without long" / "with long"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True,
                        help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--models", default=None,
                        help="comma list of models (LoRA adapters and/or the base) the "
                             "requests name in turn, request i the (i mod n)th")
    parser.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="how to ask for ignore_eos: openai (kvrelay, vLLM, llama-server: "
                             "the ignore_eos field) or transformers (`transformers serve`)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="chat-64")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s as a Poisson process (poisson; optional for others)")
    parser.add_argument("--rates", default=None, help="a sweep: comma list, e.g. 1,2,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=None,
                        help="poisson: requests per rate (default 64, chat-64's prompts); more "
                             "make a sweep measure sustained load rather than one burst")
    parser.add_argument("--jsonl", default=None, help="prompts for --workload jsonl")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="override the workload's max_tokens (128)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="send at most the first N requests (in arrival order) per run")
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds per run; unfinished requests are then cancelled")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument("--long-short-phases", choices=["both", "with", "without"],
                        default="both", help="long+short: run the short requests with and/or "
                                             "without the long prompts among them")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed requests first (the workload drawn with seed+1)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--metrics-url", action="append", default=[],
                        help="a Prometheus endpoint with the server's spec_decode counters "
                             "(kvrelay's scheduler, vLLM's /metrics; repeatable): the report "
                             "gives each run's draft acceptance")
    parser.add_argument("--label", default=None, help="name of the system in the table")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def rates_of(args) -> list[float | None]:
    if args.rates:
        return [float(rate) for rate in args.rates.split(",") if rate.strip()]
    return [args.rate]


def sweep_seed(args, index: int) -> int:
    """The prompts' seed for the sweep's index-th rate. A poisson sweep draws new prompts for
    every rate after the first: with the same ones, every later rate found them in the
    server's prefix cache and measured a lighter load than the first (both kvrelay and vLLM
    ran their first rate with 2-5x the TPOT of the next). seed + 1 is the warm-up's."""
    if args.workload != "poisson" or index == 0:
        return args.seed
    return args.seed + 1 + index


def spread_over_models(requests: list, models: str | None) -> None:
    """Request i names the (i mod n)th of `models` (its own `model`, over --model)."""
    names = [name for name in (models or "").split(",") if name]
    for index, request in enumerate(requests if names else ()):
        request.extra["model"] = names[index % len(names)]


def plan_runs(args) -> list[PlannedRun]:
    prefix = f"{args.label}: " if args.label else ""
    plans = []
    for index, rate in enumerate(rates_of(args)):
        at = f" @ {rate:g} req/s" if rate is not None else ""
        phases = ({"both": [False, True], "with": [True], "without": [False]}
                  [args.long_short_phases] if args.workload == "long+short" else [True])
        for include_long in phases:
            requests = workloads.build(args.workload, sweep_seed(args, index), rate, args.jsonl,
                                       args.max_tokens, include_long, args.num_requests)
            spread_over_models(requests, args.models)
            phase = None
            if args.workload == "long+short":
                phase = "with long" if include_long else "without long"
            label = prefix + args.workload + at + (f", {phase}" if phase else "")
            plans.append(PlannedRun(label, requests, rate, phase))
    return plans


def run(args) -> int:
    try:
        plans = plan_runs(args)
    except ValueError as exc:
        print(f"kvrelay bench serve: {exc}", file=sys.stderr)
        return 2
    result, records = run_loop(_benchmark(args, plans))
    write_outputs(result, records, args.out)
    print(report.markdown(result))
    failed = all(run["summary"]["requests_ok"] == 0 for run in result["runs"])
    return 1 if failed else 0


async def _benchmark(args, plans: list[PlannedRun]) -> tuple[dict, list]:
    options = ServerOptions(args.base_url, args.model, args.backend, args.ignore_eos,
                            args.temperature, args.api_key)
    if options.model is None:
        async with make_client(1) as client:
            options.model = await discover_model(client, options.base_url, options.api_key)
    limits = Limits(args.max_requests, args.time_limit, args.max_concurrency)
    if args.warmup:
        # Another seed's prompts, all at once (a poisson sweep's warm-up needs no rate).
        warmup_workload = "chat-64" if args.workload == "poisson" else args.workload
        warmup = workloads.build(warmup_workload, args.seed + 1, None, args.jsonl,
                                 args.max_tokens)[:args.warmup]
        spread_over_models(warmup, args.models)
        await run_workload(warmup, options, limits,
                           Progress("warm-up", len(warmup), not args.quiet))
    runs, all_records = [], []
    for plan in plans:
        total = min(len(plan.requests), args.max_requests or len(plan.requests))
        before = await spec_metrics.scrape(args.metrics_url) if args.metrics_url else None
        outcome = await run_workload(plan.requests, options, limits,
                                     Progress(plan.label, total, not args.quiet))
        runs.append(_run_entry(plan, outcome, Slo(args.slo_ttft, args.slo_tpot)))
        if args.metrics_url:
            after = await spec_metrics.scrape(args.metrics_url)
            runs[-1]["spec_decode"] = spec_metrics.acceptance(before, after)
        all_records.append((plan.label, outcome.records))
    return _result(args, options, runs), all_records


def _run_entry(plan: PlannedRun, outcome: RunResult, slo: Slo) -> dict:
    tags = sorted({r.tag for r in outcome.records if r.tag})
    return {"label": plan.label, "rate": plan.rate, "phase": plan.phase,
            "planned_requests": outcome.planned,
            "summary": summarize(outcome.records, outcome.duration_s, slo),
            "by_tag": {tag: summarize([r for r in outcome.records if r.tag == tag],
                                      outcome.duration_s, slo) for tag in tags},
            "requests": [r.to_dict() for r in outcome.records]}


def _result(args, options: ServerOptions, runs: list[dict]) -> dict:
    result = {
        "tool": "kvrelay bench serve",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "config": {"base_url": options.base_url, "model": options.model,
                   "backend": options.backend, "workload": args.workload, "seed": args.seed,
                   "rates": rates_of(args), "max_tokens": args.max_tokens,
                   "ignore_eos": options.ignore_eos, "temperature": options.temperature,
                   "max_requests": args.max_requests, "time_limit_s": args.time_limit,
                   "max_concurrency": args.max_concurrency, "warmup": args.warmup,
                   "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}},
        "runs": runs,
    }
    rated = [(run["rate"], run["summary"]) for run in runs if run["rate"] is not None]
    if len(rated) > 1:
        result["sweep"] = {"points": rated, "max_rate_goodput_90": max_rate_meeting(rated)}
    result["long_short_itl_p99_ratio"] = _long_short_ratio(runs)
    return result


def _long_short_ratio(runs: list[dict]) -> float | None:
    """ITL p99 of the short requests with the long prompts over without them."""
    p99 = {run["phase"]: run["by_tag"].get("short", {}).get("itl_s", {}).get("p99")
           for run in runs if run["phase"]}
    with_long, without = p99.get("with long"), p99.get("without long")
    return with_long / without if with_long and without else None
