"""The in-process engine core: config, requests, block pool, scheduler, model runner, sampler,
and the offline API (`LLM`). No gRPC in here; the services wrap it.

The names below load lazily: the gateway and tokenizer import only torch-free modules of this
package (sampling parameters, conversation checks) and must not pay for torch at start-up."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "kvrelay.engine.llm",
    "SamplingParams": "kvrelay.engine.sampling_params",
    "EngineConfig": "kvrelay.engine.config",
    "RequestOutput": "kvrelay.engine.outputs",
    "CompletionOutput": "kvrelay.engine.outputs",
    "Logprob": "kvrelay.engine.outputs",
    "EmbeddingRequestOutput": "kvrelay.engine.outputs",
    "EmbeddingOutput": "kvrelay.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvrelay.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
