"""Scheduler + model runner + sampler: one `step()` advances every scheduled request."""
from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig

from services.engine.config import EngineConfig
from services.engine.hardware import resolve_device, resolve_dtype
from services.engine.model_loader import check_architecture, resolve_model_dir
from services.engine.model_runner import ModelRunner
from services.engine.prefill_chunks import attention_crossover
from services.engine.request import Request
from services.engine.sampler import Sampler, SamplingRow
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.stop_checker import banned_token_ids
from services.engine.structured.backend import next_token_bitmask
from services.engine.structured.compiler import GrammarCompiler, make_backend


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request."""
    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[tuple[dict[int, float], int]] = field(default_factory=list)  # (top, rank)
    finished: bool = False


@dataclass(slots=True)
class LoadInfo:
    model_dir: str
    seconds: float


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)  # unseeded requests draw from the default generator
        self.model_dir = resolve_model_dir(config.model)
        check_architecture(self.model_dir)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.runner = ModelRunner(self.hf_config, self.model_dir, self.dtype, self.device,
                                  config.block_size, config.num_kv_blocks, config.kv_cache_memory,
                                  int4_max_tokens=config.int4_max_tokens)
        self.max_model_len = max_model_len_for(self.hf_config, config.max_model_len)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.max_model_len,
                                   attention_crossover(self.hf_config))
        self.sampler = Sampler()
        # A factory of plain values, not a bound method: a cycle through self would outlive
        # the gc.freeze() below, and with it every tensor of a discarded engine.
        self.grammars = GrammarCompiler(functools.partial(
            make_backend, config.structured_outputs_backend, self.model_dir / "tokenizer.json",
            self.hf_config.vocab_size, _eos_ids(self.hf_config)))
        self.load_info = LoadInfo(str(self.model_dir), time.perf_counter() - started)
        # torch and transformers leave ~200k objects that every full collection rescans
        # (~180 ms each); the step loop allocates enough to trigger one every few dozen steps.
        gc.collect()
        gc.freeze()

    def add_request(self, request: Request) -> None:
        vocab_size = self.hf_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab_size]
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
        bad = [t for t in request.params.token_ids_used() if t >= vocab_size]
        if bad:
            raise ValueError(f"sampling parameters name token ids out of range "
                             f"[0, {vocab_size}): {bad[:5]}")
        spec = request.params.structured_outputs
        if spec is not None and request.grammar is None:
            request.grammar = self.grammars.compile(spec).matcher()  # GrammarError: bad spec
        self.scheduler.add_request(request)



    def abort(self, request_ids) -> list[Request]:
        return self.scheduler.abort(request_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestUpdate]:
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        sampled, logprobs = self._run(output)
        num_before = {item.request.request_id: item.request.num_output_tokens
                      for item in output.scheduled}
        finished = {req.request_id for req in
                    self.scheduler.update_from_output(output, sampled)}
        return self._updates(output, num_before, logprobs, finished)

    def _run(self, output: SchedulerOutput) -> tuple[dict[str, int], dict[str, dict]]:
        step = self.runner.prepare(output.scheduled)
        if not step.sample_rows:
            self.runner.execute(step)
            return {}, {}
        logits = self.runner.execute(step)  # [S, vocab]
        requests = [output.scheduled[row].request for row in step.sample_rows]
        vocab_size = self.hf_config.vocab_size
        rows = [SamplingRow(params=req.params, prompt_token_ids=req.prompt_token_ids,
                            output_token_ids=req.output_token_ids, generator=req.generator,
                            banned_token_ids=banned_token_ids(req),
                            token_bitmask=None if req.grammar is None else torch.from_numpy(
                                next_token_bitmask(req.grammar, vocab_size)))
                for req in requests]
        result = self.sampler(logits, rows)
        sampled = {req.request_id: token for req, token in zip(requests, result.token_ids)}
        logprobs = {req.request_id: (lp, rank) for req, lp, rank
                    in zip(requests, result.logprobs, result.ranks) if lp is not None}
        return sampled, logprobs

    def _updates(self, output, num_before, logprobs, finished) -> list[RequestUpdate]:
        updates = []
        for item in output.scheduled:
            request = item.request
            new_tokens = request.output_token_ids[num_before[request.request_id]:]
            if not new_tokens and request.request_id not in finished:
                continue
            new_logprobs = []
            if request.request_id in logprobs and new_tokens:
                request.output_logprobs.append(logprobs[request.request_id])
                new_logprobs = [logprobs[request.request_id]]
            updates.append(RequestUpdate(request, new_tokens, new_logprobs,
                                         request.request_id in finished))
        return updates


def _eos_ids(hf_config) -> list[int]:
    eos = hf_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []


def max_model_len_for(hf_config, requested: int | None) -> int:
    model_max = hf_config.max_position_embeddings
    window = _sliding_window(hf_config)
    if window is not None and window < model_max:
        # Attention here is full-context; capping the length at the window keeps it exact.
        model_max = window
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's {model_max} positions")
    return requested


def _sliding_window(hf_config) -> int | None:
    if hf_config.model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        return None
    return getattr(hf_config, "sliding_window", None)
