"""`kvrelay bench throughput`: a standard workload through the in-process engine (the offline
`LLM`), reported like `bench serve` (tok/s, TTFT / ITL / TPOT / e2e, goodput).

    kvrelay bench throughput --workload chat-64 [--dtype auto] [--rate R] [--out DIR]

Prompts are rendered with the model's chat template, as a server would. Before the timed pass
an untimed pass of the same workload drawn with seed+1 builds every batch shape's kernels
without leaving the timed prompts in the prefix cache (--no-warmup skips it).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvrelay.bench import report, workloads
from kvrelay.bench.engine_args import add_engine_arguments, engine_description, make_llm
from kvrelay.bench.engine_loop import OfflineItem, drive
from kvrelay.bench.metrics import Slo, summarize
from kvrelay.bench.outputs import command_line, write_outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="chat-64")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s as a Poisson process (default: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    add_engine_arguments(parser)


def render(llm, requests: list[workloads.BenchRequest]) -> list[OfflineItem]:
    """Token ids as a server would compute them: chat template for messages."""
    items = []
    for request in requests:
        ids = (llm.apply_chat_template(request.messages) if request.messages is not None
               else llm.tokenizer.encode(request.prompt))
        items.append(OfflineItem(ids, request.max_tokens, request.arrival_s, request.tag))
    return items


def _items(llm, args, seed: int) -> list[OfflineItem]:
    requests = workloads.build(args.workload, seed, args.rate, args.jsonl, args.max_tokens)
    return render(llm, requests[:args.max_requests] if args.max_requests else requests)


def run(args) -> int:
    try:
        workloads.build(args.workload, args.seed, args.rate, args.jsonl, args.max_tokens)
    except ValueError as exc:
        print(f"kvrelay bench throughput: {exc}", file=sys.stderr)
        return 2
    llm = make_llm(args)
    if args.warmup:
        drive(llm, _items(llm, args, args.seed + 1), time_limit_s=args.time_limit)
    print(f"[{args.workload}] running in-process...", file=sys.stderr, flush=True)
    outcome = drive(llm, _items(llm, args, args.seed), time_limit_s=args.time_limit)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    engine = engine_description(llm)
    label = f"kvrelay LLM ({engine['dtype']}, {engine['threads']} threads): {args.workload}"
    tags = sorted({r.tag for r in outcome.records if r.tag})
    result = {
        "tool": "kvrelay bench throughput", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(), "engine": engine,
        "config": {"workload": args.workload, "seed": args.seed, "rate": args.rate,
                   "max_tokens": args.max_tokens, "max_requests": args.max_requests,
                   "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}},
        "runs": [{"label": label, "rate": args.rate, "phase": None,
                  "summary": summarize(outcome.records, outcome.duration_s, slo),
                  "by_tag": {tag: summarize([r for r in outcome.records if r.tag == tag],
                                            outcome.duration_s, slo) for tag in tags},
                  "num_steps": len(outcome.step_seconds),
                  "requests": [r.to_dict() for r in outcome.records]}],
    }
    write_outputs(result, [(label, outcome.records)], args.out)
    print(report.markdown(result))
    print(f"{len(outcome.step_seconds)} engine steps", file=sys.stderr)
    return 0 if result["runs"][0]["summary"]["requests_ok"] else 1
