"""`kvrelay bench latency`: the in-process engine on batches of fixed lengths.

    kvrelay bench latency --input-len 128 --output-len 32 --batch-sizes 1,4,16,64

For each batch size, `--iters` batches of random prompts (new ones each time, so the prefix
cache never hits) are run to completion after `--warmup-iters` untimed ones. Reported per batch
size: the batch's end-to-end latency, its prefill time (until every request has its first
token), the time of each decode step after that, and output tokens/s.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from kvrelay.bench.engine_args import add_engine_arguments, engine_description, make_llm
from kvrelay.bench.engine_loop import OfflineItem, drive
from kvrelay.bench.metrics import distribution
from kvrelay.bench.outputs import command_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup-iters", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    add_engine_arguments(parser)


def random_batch(rng: random.Random, batch_size: int, input_len: int, output_len: int,
                 vocab_size: int) -> list[OfflineItem]:
    # Ids above the first few hundred avoid the special tokens at the start of most vocabularies.
    return [OfflineItem([rng.randrange(256, vocab_size) for _ in range(input_len)], output_len)
            for _ in range(batch_size)]


def measure(llm, batch: list[OfflineItem]) -> dict:
    outcome = drive(llm, batch)
    prefill_end_s = max(r.sent_s + r.ttft_s for r in outcome.records)  # from the run's start
    decode_steps = [seconds for seconds, end in zip(outcome.step_seconds, outcome.step_end_s)
                    if end > prefill_end_s]
    tokens = sum(r.output_tokens for r in outcome.records)
    return {"latency_s": outcome.duration_s, "prefill_s": prefill_end_s,
            "decode_step_s": decode_steps, "output_tokens": tokens}


def sweep_one(llm, rng, args, batch_size: int) -> dict:
    vocab = llm.engine.hf_config.vocab_size
    batches = [random_batch(rng, batch_size, args.input_len, args.output_len, vocab)
               for _ in range(args.warmup_iters + args.iters)]
    for batch in batches[:args.warmup_iters]:
        measure(llm, batch)
    timed = [measure(llm, batch) for batch in batches[args.warmup_iters:]]
    latency = distribution([t["latency_s"] for t in timed])
    return {"batch_size": batch_size, "latency_s": latency,
            "prefill_s": distribution([t["prefill_s"] for t in timed]),
            "decode_step_s": distribution([s for t in timed for s in t["decode_step_s"]]),
            "output_tokens_per_s": sum(t["output_tokens"] for t in timed)
            / sum(t["latency_s"] for t in timed)}


def markdown(rows: list[dict], engine: dict, args) -> str:
    lines = [f"input {args.input_len} tokens, output {args.output_len} tokens, "
             f"{engine['dtype']}, {engine['threads']} threads, {args.iters} iterations",
             "", "| batch | latency s p50 / p90 | prefill s p50 | decode step ms p50 / p90 "
             "| output tok/s |", "|---|---|---|---|---|"]
    for row in rows:
        step = row["decode_step_s"]
        step_ms = ("-" if step["p50"] is None
                   else f"{step['p50'] * 1e3:.1f} / {step['p90'] * 1e3:.1f}")
        lines.append(f"| {row['batch_size']} | {row['latency_s']['p50']:.3f} / "
                     f"{row['latency_s']['p90']:.3f} | {row['prefill_s']['p50']:.3f} | "
                     f"{step_ms} | {row['output_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    sizes = [int(size) for size in args.batch_sizes.split(",") if size.strip()]
    if not sizes or min(sizes) < 1 or args.iters < 1 or args.input_len < 1 \
            or args.output_len < 1:
        print("kvrelay bench latency: batch sizes, --iters and lengths must be >= 1",
              file=sys.stderr)
        return 2
    llm = make_llm(args)
    rng = random.Random(args.seed)
    rows = []
    for size in sizes:
        print(f"[latency] batch {size}...", file=sys.stderr, flush=True)
        rows.append(sweep_one(llm, rng, args, size))
    engine = engine_description(llm)
    table = markdown(rows, engine, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latency.json").write_text(json.dumps(
        {"tool": "kvrelay bench latency", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "command": command_line(), "engine": engine,
         "config": {"input_len": args.input_len, "output_len": args.output_len,
                    "iters": args.iters, "warmup_iters": args.warmup_iters,
                    "seed": args.seed}, "rows": rows}, indent=1))
    (args.out / "latency.md").write_text(table)
    print(table)
    return 0
