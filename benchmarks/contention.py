"""How much a decode step slows when something else takes a share of the CPU.

    python benchmarks/contention.py [--duties 0,0.25,0.5] [--rounds 3]

A stack's front services (gateway, tokenizer, scheduler) and the benchmark client share the
cores with the worker's OpenMP threads. This measures the offline engine's 64-sequence decode
step (median) while a helper process spins for `duty` of every 8 ms on one core and sleeps the
rest. Each round runs every duty once, so the machine's drift hits them alike.
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrelay.engine import LLM, SamplingParams  # noqa: E402

PERIOD_S = 0.008
HOG = """
import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < duty * period:
        pass
    time.sleep((1 - duty) * period)
"""


def decode_step_ms(llm: LLM, rng: random.Random, tag: str, batch: int = 64,
                   prompt_len: int = 200, steps: int = 40) -> float:
    """Median decode step of `batch` sequences (the prefill steps are left out)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for index in range(batch):
        token_ids = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        for request in llm._make_requests(f"{tag}-{index}", token_ids, params, 0):
            engine.add_request(request)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def with_hog(duty: float, measure) -> float:
    if duty <= 0:
        return measure()
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(duty), str(PERIOD_S)])
    try:
        time.sleep(0.2)
        return measure()
    finally:
        hog.kill()
        hog.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duties", default="0,0.25,0.5",
                        help="shares of one core the helper process spins for")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    duties = [float(d) for d in args.duties.split(",")]
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=8192)
    rng = random.Random(0)
    decode_step_ms(llm, rng, "warmup")
    results = {duty: [] for duty in duties}
    for round_index in range(args.rounds):
        for duty in duties:
            tag = f"r{round_index}-{duty}"
            results[duty].append(with_hog(duty, lambda: decode_step_ms(llm, rng, tag)))
    print(step_table("helper's share of one core", "none",
                     {f"{duty:.0%}": times for duty, times in results.items()}))


def step_table(case_header: str, first_case: str, results: dict[str, list[float]]) -> str:
    """Markdown: each case's median decode step (and each round's), relative to the first."""
    lines = [f"| {case_header} | decode step (64 sequences) ms, median; each round | "
             f"vs {first_case} |", "|---|---|---|"]
    base = statistics.median(next(iter(results.values())))
    for case, times in results.items():
        each = ", ".join(f"{t:.1f}" for t in times)
        lines.append(f"| {case} | {statistics.median(times):.1f} ({each}) | "
                     f"{statistics.median(times) / base:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
