"""What speculation can gain on a workload: its greedy outputs replayed through the proposers.

    python -m benchmarks.spec_replay [--workload grounded] [--requests 32] [--max-tokens 128]
        [--outputs FILE] [--configs JSON;JSON...] [--step-ms 1:6.0,2:7.4,...]
        [--measure-rows 5] [engine flags, as in `kvrelay bench latency`]

Greedy speculation emits exactly the tokens the model emits without it, so once those tokens are
known (generated here with speculation off, or read back with --outputs), every proposer can be
replayed offline without the model: at each step the scheduler's own Drafter (its proposers, its
adaptive k, its room rules) drafts from the request's tokens so far, the drafts equal to the next
true tokens are accepted, and one more token is emitted. The replay counts steps, drafting steps,
query rows and emitted tokens per step.

Tokens per step is the speedup if a verify step cost what a one-row step costs: the ceiling for
that proposer on that workload. With the model step's cost per query rows (--step-ms, or
measured here with --measure-rows, one sequence, forced drafts, alternating shapes in one
process), the predicted speedup is tokens emitted / sum of step costs in one-row steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.forced_drafts import ForcedDrafts, distinct_prompt
from kvrelay.bench.engine_args import add_engine_arguments, make_llm
from kvrelay.engine import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.engine.spec.drafter import Drafter

DEFAULT_CONFIGS = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 5};'
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
    '"prompt_lookup_max": 5};'
    '{"method": "suffix", "num_speculative_tokens": 4};'
    '{"method": "suffix", "num_speculative_tokens": 8}')


@dataclass(slots=True)
class Replay:
    steps: int = 0
    drafting_steps: int = 0
    rows: int = 0
    emitted: int = 0
    cost: float = 0.0  # in one-row steps

    def report(self) -> dict:
        return {"steps": self.steps, "drafting": round(self.drafting_steps / self.steps, 3),
                "rows_per_step": round(self.rows / self.steps, 2),
                "tokens_per_step": round(self.emitted / self.steps, 2),
                "predicted_speedup": round(self.emitted / self.cost, 3) if self.cost else None}


def replay(samples: list[dict], config: SpeculativeConfig, max_tokens: int,
           step_cost: dict[int, float] | None) -> Replay:
    """samples: [{"prompt": token ids, "output": token ids}] in the order they ran, one at a
    time (a finished output joins the suffix proposer's global tree, as in the scheduler)."""
    drafter = Drafter(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    result = Replay()
    for index, sample in enumerate(samples):
        request = Request(f"replay-{index}", sample["prompt"], params)
        output = sample["output"]
        request.append_token(output[0])  # the prefill step's token: never speculated
        while request.num_output_tokens < len(output):
            done = request.num_output_tokens
            drafts = drafter.drafts(request, num_running=1, room=config.num_speculative_tokens)
            accepted = 0
            while (accepted < len(drafts) and done + accepted < len(output)
                   and drafts[accepted] == output[done + accepted]):
                accepted += 1
            if drafts:
                drafter.record(request, len(drafts), accepted)
                result.drafting_steps += 1
            emitted = min(accepted + 1, len(output) - done)
            for token in output[done:done + emitted]:
                request.append_token(token)
            result.steps += 1
            result.rows += 1 + len(drafts)
            result.emitted += emitted
            if step_cost:
                result.cost += step_cost[min(1 + len(drafts), max(step_cost))]
        drafter.on_finished(request)
    return result


def generate_outputs(args) -> list[dict]:
    from kvrelay.bench.workloads import build

    requests = build(args.workload, seed=args.seed, max_tokens=args.max_tokens)[:args.requests]
    if any(request.messages is None for request in requests):
        raise SystemExit(f"{args.workload}: only chat workloads are replayed")
    llm = make_llm(args)
    conversations = [request.messages for request in requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return [{"prompt": list(out.prompt_token_ids), "output": list(out.outputs[0].token_ids)}
            for out in outputs]


def measure_step_ms(args, max_rows: int) -> dict[int, float]:
    """The median model step of one sequence at 1 .. max_rows query rows, shapes alternating
    over rounds in one process (benchmarks/forced_drafts.py)."""
    llm = make_llm(args, speculative_config={
        "method": "ngram", "num_speculative_tokens": max_rows - 1, "disable_by_batch_size": 0})
    forced = ForcedDrafts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=61, ignore_eos=True)
    samples: dict[int, list[float]] = {rows: [] for rows in range(1, max_rows + 1)}
    for round_index in range(3):
        for rows in samples:
            prompt = {"prompt_token_ids": distinct_prompt(args.context, 0, round_index)}
            samples[rows].append(forced.time_steps([prompt], params, rows - 1))
    return {rows: statistics.median(times) for rows, times in samples.items()}


def parse_step_ms(text: str) -> dict[int, float]:
    pairs = (item.split(":") for item in text.split(",") if item.strip())
    return {int(rows): float(ms) for rows, ms in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="grounded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--outputs", type=Path, default=None,
                        help="read the greedy outputs from this JSON (written if it is absent)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="speculative configs to replay, as JSON objects separated by ';'")
    parser.add_argument("--step-ms", default=None, help="model step ms per query rows: 1:6.0,...")
    parser.add_argument("--measure-rows", type=int, default=0,
                        help="measure the step at 1 .. N query rows here (one sequence)")
    parser.add_argument("--context", type=int, default=480,
                        help="prompt tokens of the measured sequence")
    add_engine_arguments(parser)
    parser.set_defaults(dtype="bfloat16")
    args = parser.parse_args()

    if args.outputs is not None and args.outputs.exists():
        samples = json.loads(args.outputs.read_text())
    else:
        samples = generate_outputs(args)
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(samples))
    step_ms = parse_step_ms(args.step_ms) if args.step_ms else None
    if args.measure_rows:
        step_ms = measure_step_ms(args, args.measure_rows)
    step_cost = {rows: ms / step_ms[1] for rows, ms in step_ms.items()} if step_ms else None
    if step_cost is not None:
        print("model step by query rows, ms:",
              ", ".join(f"{rows}: {ms:.2f}" for rows, ms in sorted(step_ms.items())))
        missing = [rows for rows in range(1, max(step_cost) + 1) if rows not in step_cost]
        if missing:
            parser.error(f"--step-ms lacks rows {missing}")
    print(f"{len(samples)} outputs of {args.workload}, "
          f"{sum(len(s['output']) for s in samples)} tokens")
    for text in args.configs.split(";"):
        config = SpeculativeConfig.parse(text)
        if step_cost is not None and 1 + config.num_speculative_tokens > max(step_cost):
            print(f"{text.strip()}: rows past the measured {max(step_cost)} cost as that many")
        print(text.strip(), json.dumps(replay(samples, config, args.max_tokens, step_cost).report()),
              flush=True)


if __name__ == "__main__":
    main()
