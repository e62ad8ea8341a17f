"""Embeddings throughput: 64 inputs of 32-512 tokens (seeded), each its own /v1/embeddings
request, all in flight at once, beside vLLM's CPU build serving the same model for embeddings
(`--runner pooling --convert embed`: last-token pooling, normalized, as kvrelay's default).

    python -m benchmarks.embeddings [--systems kvrelay-pd,vllm-cpu] [--rounds 3] [--out DIR]

Per system and round: inputs/s and prompt tokens/s over the wall time of the batch (after one
warm-up batch of other inputs), and the median cosine similarity of its vectors to the first
system's (the same model in bf16 both sides: near 1, a check that both pool the same way).
Inputs are token id lists, so every system embeds exactly the same tokens."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks import compare
from benchmarks.peers.common import stop
from benchmarks.summary import markdown_table

VLLM_EMBED_FLAGS = "@runner=pooling@convert=embed"


def inputs(count: int, low: int, high: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """Token id lists of uniform random lengths in [low, high]; ids clear of the special ones."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


async def embed_all(base_url: str, batch: list[list[int]]) -> tuple[float, list[list[float]]]:
    """(wall seconds, the vectors in order): every input its own request, all at once."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(ids: list[int]) -> list[float]:
            response = await client.post("/v1/embeddings", json={"model": model, "input": ids})
            response.raise_for_status()
            return response.json()["data"][0]["embedding"]

        started = time.perf_counter()
        vectors = await asyncio.gather(*(one(ids) for ids in batch))
        return time.perf_counter() - started, vectors


def measure(system: str, args, batches: list[list[list[int]]]) -> dict:
    name = system + VLLM_EMBED_FLAGS if system == "vllm-cpu" else system
    out = args.out / system
    compare_args = compare.parse_args(["--systems", name, "--out", str(out), "--dtype",
                                       args.dtype, "--threads", str(args.threads),
                                       "--no-update"] + (["--home", args.home] if args.home
                                                         else []))
    server = compare.launch(name, compare_args, compare.free_port_block(), out)
    try:
        asyncio.run(embed_all(server.base_url, batches[0]))  # warm-up
        runs = [asyncio.run(embed_all(server.base_url, batch)) for batch in batches[1:]]
    finally:
        stop(server.process, grace_s=60)
    return {"system": server.name, "command": server.command, "seconds": [s for s, _ in runs],
            "vectors": [vectors for _, vectors in runs]}


def cosine(first: list[list[float]], second: list[list[float]]) -> float:
    a, b = np.asarray(first), np.asarray(second)
    similarity = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(np.median(similarity))


def report(results: list[dict], batches: list[list[list[int]]]) -> str:
    num_tokens = [sum(map(len, batch)) for batch in batches[1:]]
    base = results[0]
    rows = []
    for result in results:
        rates = [len(batch) / seconds for batch, seconds in zip(batches[1:], result["seconds"])]
        tokens = [count / seconds for count, seconds in zip(num_tokens, result["seconds"])]
        ratios = [mine / theirs for mine, theirs in zip(result["seconds"], base["seconds"])]
        rows.append([result["system"], " / ".join(f"{rate:.1f}" for rate in rates),
                     " / ".join(f"{rate:.0f}" for rate in tokens),
                     " / ".join(f"{1 / ratio:.2f}x" for ratio in ratios),
                     f"{cosine(result['vectors'][0], base['vectors'][0]):.4f}"])
    return markdown_table(["system", "inputs/s (per round)", "tokens/s", f"vs {base['system']}",
                           "cosine to it"], rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="kvrelay-pd,vllm-cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results/embeddings"))
    args = parser.parse_args(argv)
    batches = [inputs(args.inputs, args.min_tokens, args.max_tokens, args.seed + index)
               for index in range(args.rounds + 1)]
    results = [measure(system, args, batches) for system in args.systems.split(",")]
    table = report(results, batches)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        [{key: value for key, value in result.items() if key != "vectors"}
         for result in results], indent=1))
    (args.out / "report.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
