"""Loads the model runner for a worker from its flags."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from kvrelay.engine.engine_core import max_model_len_for
from kvrelay.engine.hardware import resolve_device, resolve_dtype
from kvrelay.engine.llm import eos_token_ids
from kvrelay.engine.model_loader import check_architecture, resolve_model_dir
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.parallel.followers import start_ranks, stop_followers
from kvrelay.engine.prefill_chunks import attention_crossover
from kvrelay.worker import kv_budget
from kvrelay.worker.rank_group import placement


@dataclass(slots=True)
class LoadedModel:
    runner: ModelRunner
    model_name: str
    kv_budget_reason: str  # how the KV cache's size was chosen
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    attention_crossover: int
    num_threads: int  # of the compute thread (this runs on it), for its steps: one rank's
    followers: list  # the other ranks' processes (tensor parallel), empty for one rank


def load_worker_model(args, kv_cache_path: str | None) -> LoadedModel:
    """kv_cache_path: a shared file for the KV cache (the shm transport's, or a group's)."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = resolve_model_dir(args.model)
    check_architecture(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    kv_size = KvSizer(args, kv_cache_path, device)
    runner_args = (hf_config, model_dir, dtype, device, args.block_size, args.num_kv_blocks,
                   kv_size)
    runner_kwargs = dict(kv_cache_path=kv_cache_path, int4_max_tokens=args.int4_max_tokens,
                         amx_max_tokens=args.amx_max_tokens,
                         q4a8_max_tokens=args.q4a8_max_tokens,
                         int8_activations=args.int8_activations,
                         kv_cache_dtype=args.kv_cache_dtype,
                         expert_parallel=args.enable_expert_parallel)
    tp, pp, followers = start_ranks(args, runner_args, runner_kwargs,
                                    args.tensor_parallel_timeout, placement(args))
    try:
        runner = ModelRunner(*runner_args, **runner_kwargs, tp=tp, pp=pp)
    except BaseException:
        stop_followers(pp if pp.size > 1 else tp, followers)
        raise
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LoadedModel(runner, _model_name(args.model, model_dir), kv_size.reason,
                       max_model_len_for(hf_config, args.max_model_len), hf_config.vocab_size,
                       eos_token_ids(hf_config, model_dir, tokenizer),
                       attention_crossover(hf_config), torch.get_num_threads(), followers)


class KvSizer:
    """The KV cache's size in bytes, asked for by the runner once the weights are in memory
    (what is free then is what the cache can take); remembers how it was chosen."""

    def __init__(self, args, shm_path: str | None, device: torch.device) -> None:
        self.args, self.shm_path, self.device = args, shm_path, device
        self.reason = "--num-kv-blocks"  # unless the runner asks

    def __call__(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            view = kv_budget.MemoryView(total, free, "GPU")
        else:
            view = kv_budget.memory_view()
        shm_free = (kv_budget.filesystem_free(os.path.dirname(self.shm_path))
                    if self.shm_path else None)
        budget = kv_budget.resolve(self.args.kv_cache_memory,
                                   self.args.kv_cache_memory_fraction, view, shm_free)
        self.reason = budget.reason
        return budget.num_bytes


def _model_name(requested: str | None, model_dir) -> str:
    if requested is None:
        return "SmolLM2-135M-Instruct"
    return requested.rstrip("/").split("/")[-1].removesuffix(".gguf")
