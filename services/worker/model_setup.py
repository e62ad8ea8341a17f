"""Loads the model runner for a worker from its flags."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from kvrelay.engine.engine_core import max_model_len_for
from kvrelay.engine.hardware import resolve_device, resolve_dtype
from kvrelay.engine.llm import eos_token_ids
from kvrelay.engine.model_loader import check_architecture, resolve_model_dir
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.prefill_chunks import attention_crossover


@dataclass(slots=True)
class LoadedModel:
    runner: ModelRunner
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    attention_crossover: int
    num_threads: int  # of the compute thread (this runs on it), for its steps


def load_worker_model(args, shm_path: str | None) -> LoadedModel:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = resolve_model_dir(args.model)
    check_architecture(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    runner = ModelRunner(hf_config, model_dir, dtype, device, args.block_size,
                         args.num_kv_blocks, args.kv_cache_memory, kv_cache_path=shm_path,
                         int4_max_tokens=args.int4_max_tokens,
                         amx_max_tokens=args.amx_max_tokens,
                         q4a8_max_tokens=args.q4a8_max_tokens,
                         int8_activations=args.int8_activations)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LoadedModel(runner, _model_name(args.model, model_dir),
                       max_model_len_for(hf_config, args.max_model_len), hf_config.vocab_size,
                       eos_token_ids(hf_config, model_dir, tokenizer),
                       attention_crossover(hf_config), torch.get_num_threads())


def _model_name(requested: str | None, model_dir) -> str:
    if requested is None:
        return "SmolLM2-135M-Instruct"
    return requested.rstrip("/").split("/")[-1].removesuffix(".gguf")
