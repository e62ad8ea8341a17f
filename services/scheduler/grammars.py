"""The scheduler's grammar compiler: structured-output specs compiled for the served model's
tokenizer, off the event loop, once per distinct spec (engine/structured/compiler.py).

The scheduler holds every sample's matcher, computes the allowed-token bitmask of each
constrained row it schedules and advances the matcher with each token a worker samples;
workers only apply the masks. The backend is built on the first constrained request, from the
tokenizer of --model, sized to the registered workers' vocabulary.
"""
from __future__ import annotations

from kvrelay.engine.model_loader import resolve_model_dir
from kvrelay.engine.structured.compiler import GrammarCompiler, make_backend
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.messages import BOTH, DECODE, PREFILL
from kvrelay.scheduler.registry import WorkerRegistry


def scheduler_grammars(config: SchedulerConfig, registry: WorkerRegistry) -> GrammarCompiler:
    def backend():
        workers = registry.live(PREFILL, DECODE, BOTH)
        if not workers:
            raise RuntimeError("no worker registered: the vocabulary is unknown")
        info = workers[0].info
        tokenizer_json = resolve_model_dir(config.model) / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise RuntimeError(f"structured output needs {tokenizer_json}")
        return make_backend(config.structured_outputs_backend, tokenizer_json,
                            info.vocab_size, list(info.eos_token_ids))

    return GrammarCompiler(backend)
