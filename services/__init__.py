"""kvrelay: LLM serving over a paged KV cache, as asyncio gRPC services with prefill/decode
disaggregation, and an offline engine in the same process.

    from kvrelay import LLM, SamplingParams
    llm = LLM()
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))

The client lives in `kvrelay.client` (`from kvrelay.client import KvrelayClient`); `kvrelay`
or `python -m kvrelay` is the command line. The engine's names load lazily, so importing
kvrelay for the client or a service that never runs a model does not load torch.

Source layout: this package is the repository's services/ folder and `kvrelay.kernels` its
kernels/ folder (pyproject.toml maps them; docs/architecture.md says why)."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_ENGINE_EXPORTS = ("LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
                   "Logprob")
__all__ = list(_ENGINE_EXPORTS)


def __getattr__(name: str):
    if name not in _ENGINE_EXPORTS:
        raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
    return getattr(importlib.import_module("kvrelay.engine"), name)
