"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`."""
from __future__ import annotations

import itertools
import json
from typing import Any, Sequence

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.conversation import check_conversation
from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                                    Logprob, RequestOutput)
from kvrelay.engine.request import Request, RequestStatus, make_sequence_id
from kvrelay.engine.sampler import make_generator
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.step_outputs import SequenceUpdate

PromptType = str | dict[str, Any]
# Offline batches want throughput over first-token latency: a larger per-step budget admits the
# whole batch in fewer steps (vLLM's LLM class does the same). Servers keep EngineConfig's 2048.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 8192


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args) -> None:
        engine_args.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.config = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.engine.model_dir)
        self.eos_token_ids = _eos_token_ids(self.engine, self.tokenizer)
        self._ids = itertools.count()

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | dict | Sequence | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """lora: a loaded adapter's name for every prompt, or one per prompt (None: the base
        model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        token_lists = [self._prompt_token_ids(prompt) for prompt in prompts]
        texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        return self._run(token_lists, texts, sampling_params, use_tqdm, priority, lora)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | dict | Sequence | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.apply_chat_template(conversation, add_generation_prompt,
                                                **(chat_template_kwargs or {}))
                       for conversation in conversations]
        return self._run(token_lists, [None] * len(token_lists), sampling_params, use_tqdm, None,
                         lora)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in directory `path` as `name` (enable_lora=True)."""
        self.engine.load_lora(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_lora(name)

    def list_lora_adapters(self) -> list[str]:
        return [ref.name for ref in self.engine.adapters.refs()]

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling: str = "last",
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its final hidden states (after the last norm) pooled, the
        last token's or the mean of all, L2-normalized (pooling.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        token_lists = [self._prompt_token_ids(prompt) for prompt in prompts]
        texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        return [EmbeddingRequestOutput(output.request_id, output.prompt_token_ids,
                                       EmbeddingOutput(output.embedding))
                for output in self._run(token_lists, texts, params, use_tqdm, None)]

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        check_conversation(conversation)
        rendered = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- request building ----------------------------------------------------------------------
    def _prompt_token_ids(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids", "prompt"}
            if unknown:
                raise ValueError(f"unknown prompt key(s): {', '.join(sorted(unknown))}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return list(ids)
            if isinstance(prompt.get("prompt"), str):
                return self.tokenizer.encode(prompt["prompt"])
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids', "
                         f"got {type(prompt).__name__}")

    def _params_list(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, dict)):
            params = [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)
                for p in params]

    def _adapter_ids(self, lora, count: int) -> list[int]:
        names = [lora] * count if lora is None or isinstance(lora, str) else list(lora)
        if len(names) != count:
            raise ValueError(f"got {len(names)} adapter names for {count} prompts")
        ids = []
        for name in names:
            ref = None if name is None else self.engine.adapters.get(name)
            if name is not None and ref is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
            ids.append(0 if ref is None else ref.adapter_id)
        return ids

    def _make_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       priority: int, adapter_id: int = 0) -> list[Request]:
        # Without prefix caching, the salt still lets the n samples share their prompt's blocks.
        salt = None if self.config.enable_prefix_caching else request_id
        return [Request(make_sequence_id(request_id, index), token_ids,
                        params, self.eos_token_ids, priority=priority, cache_salt=salt,
                        generator=(make_generator(params.seed, index)
                                   if params.seed is not None else None),
                        adapter_id=adapter_id)
                for index in range(params.n)]

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self, token_lists, texts, params, use_tqdm, priority,
             lora=None) -> list[RequestOutput]:
        params_list = self._params_list(params, len(token_lists))
        adapter_ids = self._adapter_ids(lora, len(token_lists))
        priorities = list(priority) if priority is not None else [0] * len(token_lists)
        if len(priorities) != len(token_lists):
            raise ValueError(f"got {len(priorities)} priorities for {len(token_lists)} prompts")
        trackers = []
        for token_ids, text, sp, prio, adapter_id in zip(token_lists, texts, params_list,
                                                         priorities, adapter_ids):
            request_id = str(next(self._ids))
            trackers.append(_Tracker(request_id, text, token_ids,
                                     self._make_requests(request_id, token_ids, sp, prio,
                                                         adapter_id)))
        self._add_all(trackers)
        try:
            self._drive(trackers, use_tqdm)
        except BaseException:
            self.engine.abort([req.sequence_id for t in trackers for req in t.requests])
            raise
        return [tracker.result(self.tokenizer) for tracker in trackers]

    def _add_all(self, trackers: list["_Tracker"]) -> None:
        added = []
        try:
            for tracker in trackers:
                for request in tracker.requests:
                    self.engine.add_request(request)
                    added.append(request.sequence_id)
        except Exception:
            self.engine.abort(added)  # all or nothing: a bad prompt leaves nothing queued
            raise

    def _drive(self, trackers: list["_Tracker"], use_tqdm: bool) -> None:
        by_id = {req.sequence_id: tracker for tracker in trackers for req in tracker.requests}
        remaining = len(by_id)
        bar = tqdm(total=len(trackers), desc="Processed prompts", unit="req",
                   disable=not use_tqdm or len(trackers) < 2)
        with bar:
            while remaining:
                for update in self.engine.step():
                    tracker = by_id.get(update.request.sequence_id)
                    if tracker is None:
                        continue
                    if tracker.on_update(update, self.tokenizer, self.engine):
                        remaining -= 1
                        if tracker.done:
                            bar.update(1)
                if remaining and not self.engine.has_unfinished:
                    raise RuntimeError("engine stopped with requests unfinished")


class _Tracker:
    """Collects one prompt's n sequences; applies stop strings, which need the text."""

    def __init__(self, request_id: str, prompt: str | None, token_ids: list[int],
                 requests: list[Request]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = token_ids
        self.requests = requests
        self.stop_strings: dict[str, str] = {}  # sequence id -> stop string that ended it
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # only for stop strings
        self.num_finished = 0

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.requests)

    def on_update(self, update: SequenceUpdate, tokenizer, engine: EngineCore) -> bool:
        """Return True when this update finished the sequence."""
        request = update.request
        if not update.finished and request.params.stop:
            # Token by token: a speculative step emits several, and the output ends with the
            # one that completes the stop string.
            for count, token_id in enumerate(update.new_token_ids, start=1):
                stop = self._find_stop_string(request, [token_id], tokenizer)
                if stop is None:
                    continue
                engine.abort([request.sequence_id])
                _drop_tokens_after(request, len(update.new_token_ids) - count)
                request.status = RequestStatus.FINISHED_STOPPED
                self.stop_strings[request.sequence_id] = stop
                update.finished = True
                break
        if update.finished:
            self.num_finished += 1
        return update.finished

    def _find_stop_string(self, request: Request, new_token_ids: list[int],
                          tokenizer) -> str | None:
        detokenizer = self.detokenizers.get(request.sequence_id)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(tokenizer, request.params.skip_special_tokens)
            self.detokenizers[request.sequence_id] = detokenizer
        new_text = detokenizer.step(new_token_ids)
        if not new_text:
            return None
        # Only text that the new piece could complete: a match ends inside new_text.
        longest = max(len(stop) for stop in request.params.stop)
        window = detokenizer.text[-(len(new_text) + longest - 1):]
        found = [(window.find(stop), stop) for stop in request.params.stop if stop in window]
        return min(found)[1] if found else None

    def result(self, tokenizer) -> RequestOutput:
        outputs = [self._completion(index, req, tokenizer)
                   for index, req in enumerate(self.requests)]
        first = self.requests[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None if entry is None else _prompt_entry(entry, tokenizer)
                               for entry in first.prompt_logprobs]
        return RequestOutput(self.request_id, self.prompt, self.token_ids, outputs,
                             num_cached_tokens=first.num_cached_prompt_tokens,
                             prompt_logprobs=prompt_logprobs,
                             embedding=None if first.embedding is None else list(first.embedding))

    def _completion(self, index: int, request: Request, tokenizer) -> CompletionOutput:
        skip = request.params.skip_special_tokens
        text = tokenizer.decode(request.output_token_ids, skip_special_tokens=skip)
        stop_reason: int | str | None = request.stop_token_id
        stop = self.stop_strings.get(request.sequence_id)
        if stop is not None:
            text = text[:text.find(stop)]
            stop_reason = stop
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = [_logprob_entry(entry, rank, token, tokenizer) for (entry, rank), token
                        in zip(request.output_logprobs, request.output_token_ids)]
        return CompletionOutput(index, text, list(request.output_token_ids),
                                request.finish_reason, stop_reason, logprobs)


def _drop_tokens_after(request: Request, num_extra: int) -> None:
    """A finished request keeps no token past the one that ended it."""
    if num_extra:
        del request.output_token_ids[-num_extra:]
        del request.all_token_ids[-num_extra:]
        del request.output_logprobs[len(request.output_token_ids):]


def _logprob_entry(entry: dict[int, float], rank: int, sampled: int,
                   tokenizer) -> dict[int, Logprob]:
    ordered = sorted(entry.items(), key=lambda item: -item[1])
    ranks = {token: position + 1 for position, (token, _) in enumerate(ordered)}
    ranks[sampled] = rank
    return {token: Logprob(value, ranks[token], tokenizer.decode([token]))
            for token, value in entry.items()}


def _prompt_entry(entry, tokenizer) -> dict[int, Logprob]:
    """A prompt token's TokenLogprob as vLLM shows it: the token and its top alternatives."""
    values = dict(entry.top)
    values[entry.token_id] = entry.logprob
    ranks = {token: position + 1 for position, (token, _) in enumerate(entry.top)}
    ranks[entry.token_id] = entry.rank
    return {token: Logprob(value, ranks[token], tokenizer.decode([token]))
            for token, value in values.items()}


def _eos_token_ids(engine: EngineCore, tokenizer) -> frozenset[int]:
    return eos_token_ids(engine.hf_config, engine.model_dir, tokenizer)


def eos_token_ids(hf_config, model_dir, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the config's, the tokenizer's and generation_config's."""
    ids: set[int] = set()
    for source in (hf_config.eos_token_id, tokenizer.eos_token_id,
                   _generation_config_eos(model_dir)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)


def _generation_config_eos(model_dir):
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
