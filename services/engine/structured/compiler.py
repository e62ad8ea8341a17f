"""Compiled grammars, cached by spec, compiled off the event loop.

One compiler per process that samples under grammars (the scheduler service, or the offline
engine). The backend is built on first use: loading the tokenizer's vocabulary into it takes a
fraction of a second, which a server that never sees a constrained request should not pay.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvrelay.engine.structured.backend import CompiledGrammar, GrammarBackend, GrammarError
from kvrelay.engine.structured.spec import StructuredOutputs

DEFAULT_CACHE_SIZE = 256


def make_backend(name: str, tokenizer_json_path: Path, vocab_size: int,
                 eos_token_ids: list[int]) -> GrammarBackend:
    if name == "llguidance":
        from kvrelay.engine.structured.llguidance_backend import LlguidanceBackend
        return LlguidanceBackend(tokenizer_json_path.read_text(), vocab_size, eos_token_ids)
    if name == "xgrammar":
        from kvrelay.engine.structured.xgrammar_backend import XgrammarBackend
        return XgrammarBackend(tokenizer_json_path, vocab_size, eos_token_ids)
    raise ValueError(f"grammar backend must be llguidance or xgrammar, got {name!r}")


class GrammarCompiler:
    def __init__(self, backend_factory: Callable[[], GrammarBackend],
                 cache_size: int = DEFAULT_CACHE_SIZE, max_workers: int = 1) -> None:
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()  # one backend, built once, whichever thread asks first
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarError] = OrderedDict()
        self._cache_size = cache_size
        self._executor = ThreadPoolExecutor(max_workers=max_workers,
                                            thread_name_prefix="grammar-compile")

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Raises GrammarError. Blocking: from async code use compile_async."""
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is not None:
                self._cache.move_to_end(spec.key)
        if cached is None:
            cached = self._compile_uncached(spec)
        if isinstance(cached, GrammarError):
            raise cached
        return cached

    async def compile_async(self, spec: StructuredOutputs) -> CompiledGrammar:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.compile,
                                                                spec)

    def _compile_uncached(self, spec: StructuredOutputs) -> CompiledGrammar | GrammarError:
        try:
            result: CompiledGrammar | GrammarError = self.backend.compile(spec)
        except GrammarError as exc:
            result = exc  # cached too: the same bad schema sent again fails as fast
        with self._lock:
            self._cache[spec.key] = result
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
