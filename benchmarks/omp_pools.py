"""The decode step when a second thread of the process has run torch ops (OpenMP pools).

    python benchmarks/omp_pools.py [--rounds 3]

A worker runs its forward passes on a compute thread while its event loop thread copies KV
pages. Each case runs in a fresh process (libgomp's pools last as long as the process), loads
the engine on a compute thread, and times the median 64-sequence decode step there:

- `one thread`: no other thread runs torch ops;
- `second thread parallel`: the main thread has copied pages with torch's default threads, so
  libgomp has two pools, more threads than CPUs, and throttles every pool's spinning;
- `second thread inline`: the same copies after `run_torch_ops_inline()` (what workers do).

The cases take turns round by round, so the machine's drift hits them alike.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.contention import step_table  # noqa: E402

CASES = ("one thread", "second thread parallel", "second thread inline")


def run_case(case: str) -> float:
    import torch

    from benchmarks.contention import decode_step_ms
    from kvrelay.engine import LLM
    from kvrelay.engine.omp_threads import run_torch_ops_inline

    if case == "second thread inline":
        run_torch_ops_inline()
    compute = ThreadPoolExecutor(1)
    llm = compute.submit(LLM, dtype="auto", max_num_batched_tokens=8192).result()
    rng = random.Random(0)
    compute.submit(decode_step_ms, llm, rng, "warmup").result()
    if case != "one thread":
        # Pages of 200 blocks of every layer, as a KV send or receive copies them.
        cache = torch.zeros(30, 2, 512, 16, 3, 64, dtype=torch.bfloat16)
        blocks = torch.arange(0, 400, 2)
        cache.index_copy_(2, blocks + 1, cache.index_select(2, blocks))
    return compute.submit(decode_step_ms, llm, rng, "timed").result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    results = {case: [] for case in CASES}
    for round_index in range(args.rounds):
        order = CASES if round_index % 2 == 0 else CASES[::-1]
        for case in order:
            output = subprocess.run([sys.executable, __file__, "--case", case], check=True,
                                    capture_output=True, text=True).stdout
            results[case].append(json.loads(output.strip().splitlines()[-1]))
            print(f"round {round_index + 1}: {case} {results[case][-1]:.1f} ms", flush=True)
    print(step_table("torch ops outside the compute thread", CASES[0], results))


if __name__ == "__main__":
    main()
