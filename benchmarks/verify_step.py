"""What a speculative verify step costs against a plain decode step, offline.

    python benchmarks/verify_step.py [--rows 1,3,5,9] [--sequences 1] [--context 480]
                                     [--rounds 2] [--runs-switch | --switch VAR] [engine flags, as in
                                     `kvrelay bench latency`: --q4a8-max-tokens N, ...]

Each sequence drafts rows - 1 tokens every step (its last token repeated, so most are rejected
and the next step has the same shape), and the median model step of each shape is reported.
With --runs-switch every shape runs twice per round, with KVRELAY_DECODE_RUNS=0 (each decode
row alone) and =1 (a sequence's rows as one causal block on the prefill kernel), alternating
within one process, since this machine drifts by 20% between processes. --switch VAR does the
same with another of the kernels' runtime switches (KVRELAY_DECODE_SPLIT: a step of few rows
cuts each row's keys into parts for the threads).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrelay.bench.engine_args import add_engine_arguments, make_llm  # noqa: E402
from kvrelay.engine import LLM, SamplingParams  # noqa: E402

RUNS_SWITCH = "KVRELAY_DECODE_RUNS"
MAX_DRAFTS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,3,5,9", help="query rows per sequence per step")
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--context", type=int, default=480, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per shape")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs-switch", action="store_true",
                        help=f"alternate {RUNS_SWITCH}=0 and =1 (same as --switch {RUNS_SWITCH})")
    parser.add_argument("--switch", default=None, metavar="VAR",
                        help="alternate this environment variable between 0 and 1")
    add_engine_arguments(parser)
    parser.set_defaults(dtype="bfloat16")
    args = parser.parse_args()
    rows_list = [int(rows) for rows in args.rows.split(",")]
    if not all(1 <= rows <= MAX_DRAFTS + 1 for rows in rows_list):
        parser.error(f"--rows must lie in [1, {MAX_DRAFTS + 1}]")
    llm = make_llm(args, speculative_config={
        "method": "ngram", "num_speculative_tokens": MAX_DRAFTS, "disable_by_batch_size": 0})
    forced = ForcedDrafts(llm)
    switch_name = args.switch or RUNS_SWITCH
    switch = ("0", "1") if args.runs_switch or args.switch else (os.environ.get(switch_name, "1"),)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    print(f"{args.sequences} sequence(s) of {args.context} prompt tokens, {args.dtype}, "
          f"median model step of the last {args.steps - 3}")
    for round_index in range(args.rounds):
        for rows in rows_list:
            for runs in switch:
                os.environ[switch_name] = runs
                prompts = [{"prompt_token_ids": _prompt(args.context, seq, round_index)}
                           for seq in range(args.sequences)]
                step_ms = forced.time_steps(prompts, params, rows - 1)
                print(f"rows {rows:2d}  {switch_name}={runs}  step {step_ms:6.2f} ms", flush=True)


def _prompt(length: int, seq: int, round_index: int) -> list[int]:
    # distinct per sequence and round: no prefix-cache hit shortens a prefill
    return [(i * 7919 + 13 * seq + 101 * round_index) % 40000 + 100 for i in range(length)]


class ForcedDrafts:
    """Makes every sequence of `llm` draft a fixed number of tokens a step and times the model
    steps (the runner's execute)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.num_drafts = 0
        self.step_seconds: list[float] = []
        engine = llm.engine
        engine.scheduler.drafter.drafts = self._drafts
        execute = engine.runner.execute

        def timed(step):
            started = time.perf_counter()
            result = execute(step)
            self.step_seconds.append(time.perf_counter() - started)
            return result

        engine.runner.execute = timed

    def _drafts(self, request, num_running: int, room: int) -> list[int]:
        return [request.output_token_ids[-1]] * min(self.num_drafts, room)

    def time_steps(self, prompts: list[dict], params: SamplingParams, num_drafts: int) -> float:
        self.num_drafts = num_drafts
        self.step_seconds.clear()
        self.llm.generate(prompts, params, use_tqdm=False)
        decode = self.step_seconds[3:]  # past the prefill steps
        return 1000 * statistics.median(decode)


if __name__ == "__main__":
    main()
