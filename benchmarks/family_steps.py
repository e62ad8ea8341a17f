"""Each family's decode step beside the Llama path's at equal FLOPs, in one process.

    python -m benchmarks.family_steps --checkpoints DIR [--families llama,qwen3,gemma3,qwen3_moe]
                                      [--batches 1,64] [--steps 32] [--rounds 5]

DIR holds the random checkpoints of benchmarks/family_checkpoints.py, one folder per family
(`llama` is the default model's architecture with random bf16 weights: the baseline). Every
family has the same dimensions, so a step multiplies the same weights' worth of FLOPs (Qwen3-MoE:
the same active MLP parameters). A decode step's time is taken through the offline engine, as
the server runs it: B prompts of 32 tokens generate 1 token, then 1 + S tokens; the difference
over S is one step of B rows (scheduling and sampling included). Each round times every family
once, in turn, so that the machine's drift touches all of them alike; the medians are reported,
with each family's ratio to Llama's step per round.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

PROMPT_TOKENS = 32
BASELINE = "llama"


def _prompts(batch: int, vocab: int) -> list[dict]:
    """B distinct prompts of PROMPT_TOKENS token ids (no prefix shared: each step's rows all
    attend to their own keys)."""
    return [{"prompt_token_ids": [(7 + 31 * row + 13 * pos) % vocab
                                  for pos in range(PROMPT_TOKENS)]} for row in range(batch)]


def _generate_s(llm, prompts: list[dict], max_tokens: int) -> float:
    from kvrelay import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def step_ms(llm, batch: int, steps: int, vocab: int) -> float:
    """One decode step of `batch` rows, in ms: (time for 1 + steps tokens - time for 1) / steps."""
    prompts = _prompts(batch, vocab)
    short = _generate_s(llm, prompts, 1)
    long = _generate_s(llm, prompts, 1 + steps)
    return (long - short) / steps * 1e3


def _load(directory: Path):
    from kvrelay import LLM
    # no prefix caching: every round recomputes its prompts, as the first round did
    return LLM(model=str(directory), dtype="bfloat16", enable_prefix_caching=False)


def time_round(checkpoints: Path, families: list[str], batches: list[int],
               steps: int) -> dict[str, dict[int, float]]:
    """{family: {batch: step ms}}, one model resident at a time."""
    times = {}
    for family in families:
        directory = checkpoints / family
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        llm = _load(directory)
        for batch in batches:  # a warm-up pass per batch size: oneDNN compiles per row count
            step_ms(llm, batch, 2, vocab)
        times[family] = {batch: step_ms(llm, batch, steps, vocab) for batch in batches}
        del llm
        gc.collect()
    return times


def report(rounds: list[dict[str, dict[int, float]]], batches: list[int]) -> str:
    lines = ["| family | batch | step ms (median) | vs Llama per round | median |",
             "|---|---|---|---|---|"]
    for family in rounds[0]:
        for batch in batches:
            ms = [r[family][batch] for r in rounds]
            ratios = [r[family][batch] / r[BASELINE][batch] for r in rounds]
            lines.append(f"| {family} | {batch} | {statistics.median(ms):.2f} | "
                         f"{', '.join(f'{x:.2f}x' for x in ratios)} | "
                         f"**{statistics.median(ratios):.2f}x** |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--families", default="llama,qwen3,gemma3,qwen3_moe")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the rounds as JSON")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    if BASELINE not in families:
        families.insert(0, BASELINE)
    batches = [int(b) for b in args.batches.split(",")]
    rounds = []
    for index in range(args.rounds):
        rounds.append(time_round(args.checkpoints, families, batches, args.steps))
        print(f"round {index}: {json.dumps(rounds[-1])}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rounds, indent=1))
    print(report(rounds, batches))


if __name__ == "__main__":
    main()
