"""Issue 4's GPU check in one command: the Triton kernels against their torch references on
CUDA, then speed against the device's own copy bandwidth, with random weights and
Llama-3-8B's config (bfloat16; no checkpoint is read or downloaded).

    python -m benchmarks.cuda_check --out cuda_check.json     # on a CUDA machine (~5 min)
    python -m benchmarks.cuda_check --smoke                   # the same code on a CPU, tiny

Measures, in order:
1. paged attention (decode, whole prompts, chunked prefill, mixed; bf16, fp16, fp32 and 8-bit
   int8/fp8 caches; Llama-3-8B and SmolLM2 head shapes), the KV store and the speculative
   rejection kernel against the references, on fresh random inputs;
2. the device's copy bandwidth (one large device-to-device copy, read + write bytes);
3. the decode attention kernel's achieved bandwidth, batch 1-128 x context 1k-32k;
4. one decode step of the whole model against its roofline (every weight and every
   sequence's KV read once at the copy bandwidth), batch 1-128 at context 1,024;
5. the engine's offline throughput: 256 random 512-token prompts, 128 greedy tokens each.
Prints a markdown report for BENCHMARKS.md and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # read when the Triton kernels are decorated, so before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from benchmarks import cuda_engine, cuda_kernels
from benchmarks.summary import markdown_table


def run(device: torch.device, smoke: bool, max_kv_gib: float) -> dict:
    report: dict = {"date": time.strftime("%Y-%m-%d"), "smoke": smoke,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "torch": torch.__version__}
    report["checks"] = (cuda_kernels.check_attention(device, smoke)
                        + cuda_kernels.check_attention_8bit(device, smoke)
                        + cuda_kernels.check_store_kv(device, smoke)
                        + cuda_kernels.check_rejection(device, smoke)
                        + cuda_kernels.check_moe(device, smoke))
    bandwidth = cuda_kernels.copy_bandwidth(device, smoke)
    report["copy_bytes_per_s"] = bandwidth
    report["attention"] = cuda_kernels.attention_bandwidth(device, smoke, bandwidth,
                                                           max_kv_gib * (1 << 30))
    config = cuda_engine.tiny_config() if smoke else cuda_engine.llama3_8b_config()
    dtype = torch.float32 if smoke and device.type == "cpu" else torch.bfloat16
    batches, context = ((1, 4), 32) if smoke else ((1, 8, 32, 64, 128), 1024)
    blocks_needed = max(batches) * -(-(context + 1) // cuda_engine.BLOCK_SIZE)
    # Enough for the offline run: 256 x (512 + 128) tokens, 2 MiB a block for Llama-3-8B.
    num_blocks = max(blocks_needed, 256 if smoke else 12000)
    runner = cuda_engine.make_runner(config, device, dtype, num_blocks)
    report["weight_bytes"] = cuda_engine.weight_bytes(runner)
    report["decode_steps"] = cuda_engine.decode_steps(runner, config, device, bandwidth,
                                                      batches, context, smoke)
    sizes = (4, 16, 4) if smoke else (256, 512, 128)
    report["offline"] = cuda_engine.offline_throughput(runner, config, device, *sizes)
    return report


def markdown(report: dict) -> str:
    gb = lambda value: f"{value / 1e9:.0f}"  # noqa: E731
    checks = [[r["kernel"], r["heads"], r["dtype"], r["case"], f"{r['max_abs_error']:.2e}",
               "yes" if r["ok"] else "**no**"] for r in report["checks"]]
    attention = [[r["batch"], r["context"], f"{r['seconds'] * 1e6:.0f}", gb(r["bytes_per_s"]),
                  f"{r['of_copy_bandwidth']:.0%}"] for r in report["attention"]]
    steps = [[r["batch"], r["context"], f"{r['seconds'] * 1e3:.2f}",
              f"{r['roofline_seconds'] * 1e3:.2f}", f"{r['of_roofline']:.0%}"]
             for r in report["decode_steps"]]
    offline = report["offline"]
    return "\n".join([
        f"Run {report['date']} on {report['device']} (torch {report['torch']}"
        f"{', smoke test' if report['smoke'] else ''}).", "",
        markdown_table(["kernel", "heads", "dtype", "case", "max abs error vs reference", "ok"],
                       checks), "",
        f"Copy bandwidth: {gb(report['copy_bytes_per_s'])} GB/s (read + write).", "",
        markdown_table(["decode attention: batch", "context", "µs", "GB/s", "of copy bandwidth"],
                       attention), "",
        f"Weights: {report['weight_bytes'] / 1e9:.1f} GB.", "",
        markdown_table(["decode step: batch", "context", "ms", "roofline ms", "of roofline"],
                       steps), "",
        f"Offline: {offline['requests']} requests x {offline['prompt_len']} prompt "
        f"tokens, {offline['max_tokens']} greedy output tokens each: "
        f"{offline['output_tokens_per_s']:.0f} output tok/s ({offline['steps']} steps, "
        f"{offline['seconds']:.1f} s)."])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; runs on a CPU under TRITON_INTERPRET=1")
    parser.add_argument("--max-kv-gib", type=float, default=40.0,
                        help="skip attention cases whose KV is bigger")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device; use --smoke to run the same code on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    report = run(device, args.smoke, args.max_kv_gib)
    print(markdown(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if all(row["ok"] for row in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
