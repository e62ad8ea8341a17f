"""Flags shared by the in-process benchmarks, and the engine they build."""
from __future__ import annotations

import argparse

from kvrelay.kernels.kv_code_names import CHOICES as KV_CACHE_DTYPES


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="per-step token budget (default: the offline LLM's)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--int4-max-tokens", type=int, default=None,
                        help="steps of at most this many tokens use the 4-bit weights "
                             "(default: the engine's; 0: never)")
    parser.add_argument("--amx-max-tokens", type=int, default=None,
                        help="steps up to this many tokens run on AMX tiles "
                             "(default: the engine's; 0: never)")
    parser.add_argument("--q4a8-max-tokens", type=int, default=None,
                        help="where the CPU has AVX512-VNNI, steps up to this many tokens use the "
                             "VNNI kernel (default: the engine's; 0: never)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                        help="the KV cache's element (default: the engine's, the model's dtype)")
    parser.add_argument("--int8-activations", action="store_true", default=None,
                        help="where the CPU has AVX512-VNNI, every layer step on the VNNI kernel "
                             "with int8 activations")


def make_llm(args, **extra_engine_args):
    """The engine the flags describe; extra_engine_args (a speculative config, say) go to LLM
    as they are."""
    from kvrelay.engine import LLM
    engine_args = {"num_threads": args.num_threads,
                   "enable_prefix_caching": args.prefix_caching, **extra_engine_args}
    for name in ("max_num_batched_tokens", "max_num_seqs", "int4_max_tokens", "amx_max_tokens",
                 "q4a8_max_tokens", "int8_activations", "kv_cache_dtype"):
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
    return LLM(model=args.model, dtype=args.dtype, **engine_args)


def engine_description(llm) -> dict:
    import torch
    engine = llm.engine
    return {"model_dir": str(engine.model_dir),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "weights": engine.runner.quantization,
            "kv_cache_dtype": engine.runner.kv_cache_dtype_name,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "max_num_seqs": engine.config.max_num_seqs,
            "prefix_caching": engine.config.enable_prefix_caching,
            "int4_max_tokens": engine.config.int4_max_tokens if engine.runner.uses_int4 else 0,
            "int4_kernel": engine.runner.int4_kernel,
            "amx_max_tokens": engine.config.amx_max_tokens if engine.runner.uses_amx else 0,
            "q4a8": engine.runner.q4a8,
            "q4a8_max_tokens": engine.config.q4a8_max_tokens if engine.runner.q4a8 else 0}
