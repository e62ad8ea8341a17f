"""chat-64 through the in-process engine beside HF transformers, in one run.

    python -m benchmarks.offline [--dtype auto] [--hf-dtypes bfloat16,float32] [--sequential 8]

Reports output tokens/s, wall time, and TTFT / ITL where they are measurable: for kvrelay from
the step at which each request's tokens appear; for HF sequential from a streamer; HF static
batching only gives wall time (the whole batch finishes together).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.peers.hf_static import generate_all
from benchmarks.summary import markdown_table, percentile
from benchmarks.workloads import chat64
from kvrelay import LLM, SamplingParams

MAX_TOKENS = 128


@dataclass
class Result:
    system: str
    dtype: str
    threads: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_kvrelay(conversations, dtype: str, warmup_conversations=None,
                **engine_args) -> Result:
    return OfflineEngine(dtype, warmup_conversations, **engine_args).run(conversations)


class OfflineEngine:
    """One `LLM`, loaded and warmed up once, timed on as many workloads as asked."""

    def __init__(self, dtype: str, warmup_conversations=None, **engine_args) -> None:
        self.llm = LLM(dtype=dtype, **engine_args)
        self.params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        # Warm-up: first-call allocations (and, given a warm-up workload of other prompts, every
        # batch shape's oneDNN kernels, without leaving the timed prompts in the prefix cache)
        # stay out of the timing.
        if warmup_conversations:
            self.llm.generate([{"prompt_token_ids": self.llm.apply_chat_template(c)}
                               for c in warmup_conversations], self.params, use_tqdm=False)
        else:
            self.llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4),
                              use_tqdm=False)

    def run(self, conversations) -> Result:
        llm, engine = self.llm, self.llm.engine
        token_ids = [llm.apply_chat_template(c) for c in conversations]
        requests = [req for i, ids in enumerate(token_ids)
                    for req in llm._make_requests(f"bench-{i}", ids, self.params, 0)]
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        first, last, gaps = {}, {}, []
        num_steps = 0
        while engine.has_unfinished:
            updates = engine.step()
            num_steps += 1
            now = time.perf_counter()
            for update in updates:
                rid = update.request.sequence_id
                if update.new_token_ids:
                    if rid in last:
                        gaps.append(now - last[rid])
                    first.setdefault(rid, now - start)
                    last[rid] = now
        wall = time.perf_counter() - start
        output_tokens = sum(r.num_output_tokens for r in requests)
        ttfts = list(first.values())
        return Result("kvrelay LLM.generate", str(engine.dtype).removeprefix("torch."),
                      torch.get_num_threads(), len(requests), output_tokens, wall,
                      percentile(ttfts, 50), percentile(ttfts, 90),
                      _ms(percentile(gaps, 50)), _ms(percentile(gaps, 90)),
                      notes=f"{num_steps} steps, max_num_batched_tokens="
                            f"{engine.config.max_num_batched_tokens}",
                      extra={"load_s": round(engine.load_info.seconds, 2)})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _hf_model(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return model, tokenizer


def run_hf_static(conversations, model_dir, dtype: torch.dtype, batch_size: int) -> Result:
    model, tokenizer = _hf_model(model_dir, dtype)
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in conversations]
    start = time.perf_counter()
    output_tokens = generate_all(model, tokenizer, texts, batch_size, MAX_TOKENS)
    wall = time.perf_counter() - start
    return Result(f"HF static batching (batch {batch_size}, left padding)",
                  str(dtype).removeprefix("torch."), torch.get_num_threads(), len(texts),
                  output_tokens, wall)


def run_hf_sequential(conversations, model_dir, dtype: torch.dtype) -> Result:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model, tokenizer = _hf_model(model_dir, dtype)
    ttfts, gaps, output_tokens = [], [], 0
    start = time.perf_counter()
    for conversation in conversations:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=True, return_tensors="pt", return_dict=True)
        clock = Clock()
        began = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, streamer=clock,
                                 pad_token_id=tokenizer.pad_token_id)
        output_tokens += out.shape[1] - ids["input_ids"].shape[1]
        token_times = clock.times[1:]  # the first put() is the prompt
        ttfts.append(token_times[0] - began)
        gaps += [b - a for a, b in zip(token_times, token_times[1:])]
    wall = time.perf_counter() - start
    return Result("HF sequential generate", str(dtype).removeprefix("torch."),
                  torch.get_num_threads(), len(conversations), output_tokens, wall,
                  percentile(ttfts, 50), percentile(ttfts, 90), _ms(percentile(gaps, 50)),
                  _ms(percentile(gaps, 90)),
                  notes="subset of chat-64 (sequential is slow); tok/s is comparable")


def markdown(results: list[Result], baseline: str) -> str:
    base = next((r for r in results if r.system.startswith(baseline)), None)
    rows = [[r.system, r.dtype, r.threads, r.requests, f"{r.tokens_per_s:.1f}",
             f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-", f"{r.wall_s:.1f}",
             _fmt(r.ttft_p50_s), _fmt(r.ttft_p90_s), _fmt(r.itl_p50_ms), _fmt(r.itl_p90_ms),
             r.notes] for r in results]
    return markdown_table(["system", "dtype", "threads", "requests", "output tok/s",
                           "vs HF static", "wall s", "TTFT p50 s", "TTFT p90 s", "ITL p50 ms",
                           "ITL p90 ms", "notes"], rows)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", help="kvrelay dtype (auto: bf16 on AMX CPUs)")
    parser.add_argument("--kvrelay-dtypes", default="", help="extra kvrelay dtypes, comma list")
    parser.add_argument("--hf-dtypes", default="bfloat16,float32")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--sequential", type=int, default=8,
                        help="requests for HF sequential (0 to skip)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="per-step token budget (default: the LLM class's offline default)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    conversations = chat64()
    results = []
    for dtype in [args.dtype] + [d for d in args.kvrelay_dtypes.split(",") if d]:
        budget = ({} if args.max_num_batched_tokens is None
                  else {"max_num_batched_tokens": args.max_num_batched_tokens})
        results.append(run_kvrelay(conversations, dtype, **budget))
        print(markdown(results[-1:], "HF static"), flush=True)
    model_dir = _model_dir()
    for name in [d for d in args.hf_dtypes.split(",") if d]:
        results.append(run_hf_static(conversations, model_dir, getattr(torch, name),
                                     args.hf_batch_size))
        print(markdown(results[-1:], "HF static"), flush=True)
    if args.sequential:
        results.append(run_hf_sequential(conversations[:args.sequential], model_dir,
                                         getattr(torch, args.hf_dtypes.split(",")[0])))
    best_hf = max((r for r in results if r.system.startswith("HF static")),
                  key=lambda r: r.tokens_per_s, default=None)
    ordered = sorted(results, key=lambda r: r is not best_hf)
    print(f"\nchat-64, {os.cpu_count()} cores, torch {torch.__version__}\n")
    print(markdown(ordered, "HF static"))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"tokens_per_s": r.tokens_per_s}
                                         for r in results], indent=2))


def _model_dir():
    from kvrelay.engine.model_loader import resolve_model_dir
    return resolve_model_dir(None)


if __name__ == "__main__":
    main()
