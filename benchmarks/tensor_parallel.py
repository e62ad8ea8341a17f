"""Tensor parallel against one rank, offline: chat-64 (64 chats at once, 128 tokens each,
greedy, EOS ignored), or with --single-stream one chat's 128 tokens alone (ms a token), through
`LLM(tensor_parallel_size=N)`, each size in turn, in rounds of alternating order (the machine
drifts).

    .venv/bin/python -m benchmarks.tensor_parallel --sizes 1,2 --rounds 2 [--single-stream]

The model: a random checkpoint with the default model's dimensions but 8 query and 2 KV heads
(benchmarks/family_checkpoints.py, llama_tp; the default model's 9 heads split only 3 ways),
written once under --checkpoints.

Size 1 runs on every core (torch's threads); size N runs N processes with cores/N threads
each, the layers' partial outputs summed by gloo all-reduces (engine/parallel/).
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

from benchmarks.family_checkpoints import ensure_checkpoint
from benchmarks.workloads import chat64
from kvrelay import LLM, SamplingParams

MAX_TOKENS = 128
DEFAULT_CHECKPOINTS = Path.home() / ".cache" / "kvrelay-bench" / "checkpoints"


def run(size: int, dtype: str, conversations: list, model: Path, engine_args: dict) -> dict:
    # size 1 on every core, set explicitly: a split engine before it in this process left
    # torch at its rank's share of the threads
    llm = LLM(model=str(model), dtype=dtype, tensor_parallel_size=size,
              num_threads=os.cpu_count() if size == 1 else None, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.chat(conversations[:4], params, use_tqdm=False)  # warm-up: kernels for the shapes
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    del llm
    gc.collect()
    return {"size": size, "tok_s": tokens / seconds, "seconds": seconds,
            "ms_per_token": 1000 * seconds / tokens * len(conversations)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--checkpoints", type=Path, default=DEFAULT_CHECKPOINTS)
    parser.add_argument("--single-stream", action="store_true",
                        help="one chat alone: the time a token takes, not the batch's rate")
    parser.add_argument("--int4-max-tokens", type=int, default=None,
                        help="the engine's small-step limit (0: every step on oneDNN)")
    args = parser.parse_args(argv)
    model = ensure_checkpoint("llama_tp", args.checkpoints / "llama_tp")
    sizes = [int(size) for size in args.sizes.split(",")]
    conversations = chat64()[:1] if args.single_stream else chat64()
    engine_args = {} if args.int4_max_tokens is None else \
        {"int4_max_tokens": args.int4_max_tokens}
    for index in range(args.rounds):
        order = sizes if index % 2 == 0 else sizes[::-1]
        results = {size: run(size, args.dtype, conversations, model, engine_args)
                   for size in order}
        line = ", ".join(f"TP={size}: {results[size]['tok_s']:.1f} tok/s "
                         f"({results[size]['ms_per_token']:.1f} ms a token a stream)"
                         for size in sizes)
        ratio = results[sizes[-1]]["tok_s"] / results[sizes[0]]["tok_s"]
        print(f"round {index + 1} ({'/'.join(map(str, order))}): {line}; "
              f"TP={sizes[-1]} / TP={sizes[0]} {ratio:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
