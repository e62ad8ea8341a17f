"""The engine on a device with random weights and a real model config: one decode step against
its roofline, and offline throughput. Used by benchmarks/cuda_check.py (which also runs it on a
CPU with a tiny config in smoke mode)."""
from __future__ import annotations

import random
import time

import torch
from transformers import LlamaConfig

from benchmarks.cuda_kernels import device_timer
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.prefill_chunks import attention_crossover
from kvrelay.engine.request import Request
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import ScheduledRequest, Scheduler

BLOCK_SIZE = 16


def llama3_8b_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False)


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=1024, tie_word_embeddings=False)


def make_runner(config: LlamaConfig, device: torch.device, dtype: torch.dtype,
                num_blocks: int) -> ModelRunner:
    runner = ModelRunner(config, None, dtype, device, BLOCK_SIZE, num_blocks, 0)
    runner.kv_cache.normal_()  # what a random model would have written; no NaN from garbage
    return runner


def weight_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def _decoding_batch(batch: int, context: int, vocab: int) -> list[ScheduledRequest]:
    """`batch` sequences with `context` tokens in the cache, each decoding its next token."""
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    items = []
    for seq in range(batch):
        request = Request(f"s{seq}", [random.randrange(vocab) for _ in range(context + 1)],
                          SamplingParams(temperature=0.0))
        request.num_computed_tokens = context
        block_ids = list(range(seq * blocks_per_seq, (seq + 1) * blocks_per_seq))
        items.append(ScheduledRequest(request, 1, [block_ids]))  # one KV group: a dense model
    return items


def decode_steps(runner: ModelRunner, config: LlamaConfig, device: torch.device,
                 bandwidth: float, batches, context: int, smoke: bool) -> list[dict]:
    """One decode step (prepare + forward + logits) per batch size, against the time it takes
    to read every weight once and every sequence's KV at the measured copy bandwidth."""
    rows = []
    kv_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                    * (config.hidden_size // config.num_attention_heads)
                    * runner.kv_cache.element_size())
    for batch in batches:
        items = _decoding_batch(batch, context, config.vocab_size)

        def step():
            runner.execute(runner.prepare(items))
        seconds = device_timer(device, step, repeats=2 if smoke else 10)
        moved = weight_bytes(runner) + batch * context * kv_per_token
        rows.append({"batch": batch, "context": context, "seconds": seconds,
                     "roofline_seconds": moved / bandwidth,
                     "of_roofline": moved / bandwidth / seconds})
    return rows


def offline_throughput(runner: ModelRunner, config: LlamaConfig, device: torch.device,
                       num_requests: int, prompt_len: int, max_tokens: int) -> dict:
    """Greedy generation of random prompts through the engine's scheduler and this runner."""
    engine_config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=8192,
                                 max_num_seqs=256)
    scheduler = Scheduler(engine_config, runner.num_blocks, config.max_position_embeddings,
                          attention_crossover(config))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(num_requests):
        prompt = [random.randrange(config.vocab_size) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"r{index}", prompt, params))
    began, steps = time.perf_counter(), 0
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        step = runner.prepare(output.scheduled)
        logits = runner.execute(step)
        tokens = logits.argmax(dim=-1).tolist() if step.sample_rows else []
        sampled = {output.scheduled[row].request.sequence_id: [token]
                   for row, token in zip(step.sample_rows, tokens)}
        scheduler.update_from_output(output, sampled)
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return {"requests": num_requests, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "steps": steps, "seconds": seconds,
            "output_tokens_per_s": num_requests * max_tokens / seconds}
