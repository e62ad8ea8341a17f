"""LoRA serving beside the base model and beside vLLM's CPU build, in one command.

    .venv/bin/python -m benchmarks.lora --rounds 2          # ~25 min on 2 cores

chat-64 (64 chats at once, 128 tokens each) four ways per round: kvrelay PD serving the base
model; the same with its requests spread over 4 random rank-16 adapters on every projection
(q/k/v/o/gate/up/down; request i names adapter i mod 4); vLLM's CPU build the same two ways
(`--enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules ...`). The order alternates
by round (the machine drifts). Then the time to load a fifth adapter at run time through
`POST /v1/load_lora_adapter`, with and without 16 streams running, and those streams' inter-
token latency while it loads. The adapters are written once (peft, on the default model)
under --adapters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks import compare
from benchmarks.peers.common import stop
from benchmarks.peers.hf_transformers import serve_model_dir

REPO = Path(__file__).resolve().parents[1]
NUM_ADAPTERS, RANK = 4, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
API_KEY = "bench-key"


def make_adapters(directory: Path, count: int) -> dict[str, Path]:
    """`count` random adapters in the PEFT format (written once)."""
    paths = {f"lora{index}": directory / f"lora{index}" for index in range(count)}
    missing = [name for name, path in paths.items()
               if not (path / "adapter_model.safetensors").exists()]
    if missing:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(serve_model_dir(), dtype=torch.float32)
        for index, name in enumerate(paths):
            if name not in missing:
                continue
            model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                    target_modules=TARGETS))
            generator = torch.Generator().manual_seed(index)
            with torch.no_grad():
                for key, param in model.named_parameters():
                    if "lora_" in key:
                        param.copy_(torch.randn(param.shape, generator=generator)
                                    * param.shape[1] ** -0.5 * 0.25)
            model.save_pretrained(str(paths[name]))
            base = model.unload()  # the base without this adapter, for the next
    return paths


def system_flags(system: str, adapters: dict[str, Path]) -> tuple[str, list[str]]:
    """(the compare harness's system name, its flags)."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    if system == "kvrelay-pd+lora":
        return "kvrelay-pd", ["--enable-lora", "--max-loras", str(NUM_ADAPTERS),
                              "--max-lora-rank", str(RANK), "--lora-modules", ",".join(modules),
                              "--api-key", API_KEY]
    if system == "vllm-cpu+lora":
        return "vllm-cpu", ["--enable-lora", "--max-loras", str(NUM_ADAPTERS),
                            "--max-lora-rank", str(RANK), "--lora-modules", *modules]
    return system, []


def run_system(system: str, args, adapters: dict[str, Path], out: Path) -> dict:
    base, flags = system_flags(system, adapters)
    log_dir = out / system
    harness = compare.parse_args(["--systems", base, "--workloads", "chat-64",
                                  "--threads", str(args.threads), "--out", str(log_dir)])
    if base == "kvrelay-pd":
        from benchmarks.peers import kvrelay_stack
        server = kvrelay_stack.launch("pd", compare.free_port_block(), log_dir, "bfloat16",
                                      args.threads, 900, flags)
    else:
        from benchmarks.peers import vllm_cpu
        server = vllm_cpu.launch(compare.free_port_block(), log_dir / "server.log",
                                 None, "bfloat16", args.threads, 900, flags)
    try:
        command = compare.bench_command(server, "chat-64", harness, log_dir / "chat-64",
                                        args.warmup)
        if "+lora" in system:
            command += ["--models", ",".join(adapters)]
        if base == "kvrelay-pd":
            command += ["--api-key", API_KEY] if "+lora" in system else []
        subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
        summary = json.loads((log_dir / "chat-64" / "result.json").read_text())["runs"][0]
        result = {"system": system, "summary": summary["summary"]}
        if system == "kvrelay-pd+lora" and args.load_adapter:
            result["load"] = asyncio.run(measure_load(server.base_url, args.load_adapter))
        return result
    finally:
        stop(server.process, grace_s=60)


async def measure_load(base_url: str, path: Path) -> dict:
    """Seconds to load an adapter idle, then with 16 streams running, and those streams'
    inter-token gaps before and during the load."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600) as client:
        idle_s = await _load(client, "extra-idle", path)
        gaps: list[tuple[float, float]] = []  # (time, gap)
        streams = [asyncio.create_task(_stream(client, f"lora{index % NUM_ADAPTERS}", gaps))
                   for index in range(16)]
        await asyncio.sleep(4.0)
        started = time.perf_counter()
        busy_s = await _load(client, "extra-busy", path)
        ended = time.perf_counter()
        await asyncio.gather(*streams)
    during = [gap for at, gap in gaps if started <= at <= ended]
    before = [gap for at, gap in gaps if at < started]
    return {"idle_load_s": idle_s, "busy_load_s": busy_s,
            "itl_p50_before_ms": _ms(before, 50), "itl_max_before_ms": _ms(before, 100),
            "itl_p50_during_ms": _ms(during, 50), "itl_max_during_ms": _ms(during, 100)}


async def _load(client: httpx.AsyncClient, name: str, path: Path) -> float:
    started = time.perf_counter()
    response = await client.post("/v1/load_lora_adapter",
                                 json={"lora_name": name, "lora_path": str(path)})
    response.raise_for_status()
    return time.perf_counter() - started


async def _stream(client: httpx.AsyncClient, model: str, gaps: list) -> None:
    body = {"model": model, "prompt": "Tell me a long story about the sea.", "max_tokens": 160,
            "stream": True, "ignore_eos": True, "temperature": 0}
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


def _ms(values: list[float], percentile: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, len(ordered) * percentile // 100)], 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default="kvrelay-pd,kvrelay-pd+lora,vllm-cpu,vllm-cpu+lora")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--adapters", type=Path,
                        default=Path.home() / ".cache" / "kvrelay-bench" / "lora-adapters")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" /
                        time.strftime("lora-%Y%m%d-%H%M%S"))
    args = parser.parse_args(argv)
    paths = make_adapters(args.adapters, NUM_ADAPTERS + 1)
    adapters = dict(list(paths.items())[:NUM_ADAPTERS])
    args.load_adapter = list(paths.values())[NUM_ADAPTERS]
    systems = [s for s in args.systems.split(",") if s]
    rounds = []
    for index in range(args.rounds):
        order = systems if index % 2 == 0 else systems[::-1]
        results = {s: run_system(s, args, adapters, args.out / f"round{index}") for s in order}
        rounds.append(results)
        print(json.dumps({s: _row(r) for s, r in results.items()}, indent=1), flush=True)
    (args.out / "rounds.json").write_text(json.dumps(rounds, indent=1))
    print(report(rounds))
    return 0


def _row(result: dict) -> dict:
    summary = result["summary"]
    return {"tok_s": round(summary["output_tokens_per_s"], 1),
            "ttft_p50_s": summary["ttft_s"]["p50"], "tpot_p50_s": summary["tpot_s"]["p50"],
            **({"load": result["load"]} if "load" in result else {})}


def report(rounds: list[dict]) -> str:
    lines = ["| round | kvrelay base | kvrelay 4 adapters | vLLM base | vLLM 4 adapters | "
             "kvrelay adapters / base | kvrelay / vLLM, adapters |", "|---|---|---|---|---|---|---|"]
    for index, results in enumerate(rounds):
        tok = {s: r["summary"]["output_tokens_per_s"] for s, r in results.items()}
        get = lambda s: tok.get(s, float("nan"))  # noqa: E731
        lines.append(f"| {index + 1} | {get('kvrelay-pd'):.1f} | {get('kvrelay-pd+lora'):.1f} | "
                     f"{get('vllm-cpu'):.1f} | {get('vllm-cpu+lora'):.1f} | "
                     f"{get('kvrelay-pd+lora') / get('kvrelay-pd'):.2f}x | "
                     f"{get('kvrelay-pd+lora') / get('vllm-cpu+lora'):.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
