"""What another process's CPU time costs a decode step: the offline engine's steps timed while a
periodic CPU hog is switched on and off every few steps, in one process.

    python benchmarks/interference.py [--busy-ms 2] [--period-ms 20] [--sequences 64]
                                      [--context 230] [--steps 200] [--block 10]
                                      [engine flags, as in `kvrelay bench latency`]

On a served stack the front services (gateway, tokenizer, scheduler) and the client run on the
cores the decode worker's OpenMP threads use. If the cores were simply shared, a hog taking H ms
of CPU during a step would lengthen it by H / cores; every parallel region ends at a barrier,
though, so a preempted thread holds up the others, and the step grows by up to H. The hog is a
child process that spins for --busy-ms every --period-ms; it is stopped (SIGSTOP) and resumed
(SIGCONT) every --block steps, so both halves see the same machine phase. The report gives the
median step each way and the step's growth per ms of the hog's CPU time.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrelay.bench.engine_args import add_engine_arguments, make_llm  # noqa: E402
from kvrelay.engine import SamplingParams  # noqa: E402

PREFILL_STEPS = 12  # the prompts' prefill steps and the first decode steps are left out


def spin(busy_s: float, period_s: float) -> None:
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < busy_s:
            pass
        time.sleep(max(0.0, period_s - busy_s))


class HogSwitch:
    """Times each model step; switches the hog every `block` steps after the prefill."""

    def __init__(self, llm, hog: Process, block: int) -> None:
        self.hog, self.block = hog, block
        self.step_seconds: dict[bool, list[float]] = {True: [], False: []}
        self.steps, self.hog_on = 0, False
        runner = llm.engine.runner
        execute = runner.execute

        def timed(step):
            started = time.perf_counter()
            result = execute(step)
            self._after(time.perf_counter() - started)
            return result

        runner.execute = timed

    def _after(self, seconds: float) -> None:
        self.steps += 1
        if self.steps <= PREFILL_STEPS:
            return
        self.step_seconds[self.hog_on].append(seconds)
        if self.steps % self.block == 0:
            self.hog_on = not self.hog_on
            os.kill(self.hog.pid, signal.SIGCONT if self.hog_on else signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--context", type=int, default=230, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=200, help="decode steps")
    parser.add_argument("--block", type=int, default=10, help="steps between switches")
    add_engine_arguments(parser)
    parser.set_defaults(dtype="bfloat16")
    args = parser.parse_args()
    if not 0 < args.busy_ms < args.period_ms:
        parser.error("--busy-ms must lie in (0, --period-ms)")
    llm = make_llm(args)
    hog = Process(target=spin, args=(args.busy_ms / 1000, args.period_ms / 1000), daemon=True)
    hog.start()
    os.kill(hog.pid, signal.SIGSTOP)
    try:
        switch = HogSwitch(llm, hog, args.block)
        prompts = [{"prompt_token_ids": [(i * 7919 + 13 * seq) % 40000 + 100
                                         for i in range(args.context)]}
                   for seq in range(args.sequences)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.steps,
                                             ignore_eos=True), use_tqdm=False)
    finally:
        hog.kill()
    off = 1000 * statistics.median(switch.step_seconds[False])
    on = 1000 * statistics.median(switch.step_seconds[True])
    hog_ms = on * args.busy_ms / args.period_ms  # the hog's CPU time during one step
    print(f"{args.sequences} sequences, hog {args.busy_ms} ms every {args.period_ms} ms: "
          f"step {off:.2f} ms off, {on:.2f} ms on ({on / off:.3f}x); "
          f"{(on - off) / hog_ms:.2f} ms of step per ms of the hog's CPU "
          f"(shared cores would give 1 / cores)")


if __name__ == "__main__":
    main()
