"""Scheduler + model runner + sampler: one `step()` advances every scheduled request."""
from __future__ import annotations

import functools
import gc
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.hardware import resolve_device, resolve_dtype
from kvrelay.engine.model_loader import check_architecture, resolve_model_dir
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.parallel.followers import start_ranks, stop_followers
from kvrelay.engine.prefill_chunks import attention_crossover
from kvrelay.engine.prompt_checks import check_prompt_tokens
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.engine.lora.adapter_files import read_adapter
from kvrelay.engine.lora.catalog import AdapterCatalog, AdapterRef
from kvrelay.engine.spec.drafter import Drafter
from kvrelay.engine.spec.verify import EmittedRun, sample_items
from kvrelay.engine.step_outputs import SequenceUpdate, apply_step_outputs
from kvrelay.engine.structured.backend import step_bitmasks
from kvrelay.engine.structured.compiler import GrammarCompiler, make_backend


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
        runner_args = (self.hf_config, self.model_dir, self.dtype, self.device,
                       config.block_size, config.num_kv_blocks, config.kv_cache_memory)
        runner_kwargs = dict(int4_max_tokens=config.int4_max_tokens,
                             amx_max_tokens=config.amx_max_tokens,
                             q4a8_max_tokens=config.q4a8_max_tokens,
                             int8_activations=config.int8_activations,
                             kv_cache_dtype=config.kv_cache_dtype,
                             expert_parallel=config.enable_expert_parallel)
        self.tp, self.pp, self.followers = start_ranks(config, runner_args, runner_kwargs)
        group = self.pp if self.pp.size > 1 else self.tp
        try:
            self.runner = ModelRunner(*runner_args, **runner_kwargs, tp=self.tp, pp=self.pp)
        except BaseException:
            stop_followers(group, self.followers)
            raise
        self.max_model_len = max_model_len_for(self.hf_config, config.max_model_len)
        drafter = None if config.speculative_config is None else \
            Drafter(config.speculative_config)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.max_model_len,
                                   attention_crossover(self.hf_config), drafter,
                                   self.runner.kv_layout.windows)
        if self.followers:  # when the engine goes, its ranks go
            weakref.finalize(self, stop_followers, group, self.followers)
        self.adapters = AdapterCatalog()
        if config.enable_lora:
            self.runner.enable_lora(config.max_loras, config.max_lora_rank,
                                    functools.partial(running_adapters, self.scheduler))
            for name, path in (config.lora_modules or {}).items():
                self.load_lora(name, path)
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

    def load_lora(self, name: str, path: str) -> AdapterRef:
        """Read, check and register the PEFT adapter at `path` as `name` (AdapterError or
        ValueError, and nothing changes, where it cannot be)."""
        if self.runner.lora is None:
            raise ValueError("LoRA is off: start the engine with enable_lora=True")
        self.adapters.check_new(name)
        adapter = read_adapter(path, self.runner.model.spec, self.config.max_lora_rank)
        ref = self.adapters.add(name, str(path))
        self.runner.lora.add(ref.adapter_id, adapter)
        return ref

    def unload_lora(self, name: str) -> None:
        """New requests can no longer name it; the running ones finish with it."""
        ref = self.adapters.remove(name)  # KeyError: unknown
        self.runner.lora.retire(ref.adapter_id)

    def add_request(self, request: Request) -> None:
        check_prompt_tokens(request.prompt_token_ids, request.params, self.hf_config.vocab_size)
        spec = request.params.structured_outputs
        if spec is not None and request.grammar is None:
            request.grammar = self.grammars.compile(spec).matcher()  # GrammarError: bad spec
        self.scheduler.add_request(request)

    def abort(self, sequence_ids) -> list[Request]:
        return self.scheduler.abort(sequence_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[SequenceUpdate]:
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        runs = self._run(output)
        sampled = {sequence_id: run.token_ids for sequence_id, run in runs.items()}
        logprobs = {sequence_id: list(zip(run.logprobs, run.ranks))
                    for sequence_id, run in runs.items()
                    if run.logprobs and run.logprobs[0] is not None}
        updates = apply_step_outputs(self.scheduler, output, sampled, logprobs)
        for update in updates:
            update.request.output_logprobs.extend(update.new_logprobs)
        return updates

    def _run(self, output: SchedulerOutput) -> dict[str, EmittedRun]:
        step = self.runner.prepare(output.scheduled)
        result = self.runner.execute_step(step)
        logits = result.logits  # [S, vocab]
        if result.prompt_logprobs or result.pooled:
            requests = {item.request.sequence_id: item.request for item in output.scheduled}
            for scored in result.prompt_logprobs:
                requests[scored.sequence_id].add_prompt_logprobs(scored.first_position,
                                                                 scored.entries)
            for pooled in result.pooled:
                requests[pooled.sequence_id].embedding = pooled.values
        if not step.sample_rows:
            return {}
        items = [output.scheduled[row] for row in dict.fromkeys(step.sample_rows)]
        vocab_size = self.hf_config.vocab_size
        bitmasks = [None if item.request.grammar is None else torch.from_numpy(
            step_bitmasks(item.request.grammar, item.draft_token_ids, vocab_size))
            for item in items]
        runs = sample_items(self.sampler, logits, items, bitmasks)
        return {item.request.sequence_id: run for item, run in zip(items, runs)}

    @property
    def spec_decode_stats(self):
        drafter = self.scheduler.drafter
        return None if drafter is None else drafter.stats


def running_adapters(scheduler: Scheduler) -> frozenset[int]:
    """The adapter ids of the requests the scheduler runs (their slots are kept)."""
    return frozenset(request.adapter_id for request in scheduler.running)


def _eos_ids(hf_config) -> list[int]:
    eos = hf_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []


def max_model_len_for(hf_config, requested: int | None) -> int:
    model_max = hf_config.max_position_embeddings
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's {model_max} positions")
    return requested
