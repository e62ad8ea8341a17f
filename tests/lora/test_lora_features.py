"""The engine's other features with LoRA adapters, offline, float32: speculative decoding
verifies drafts with the adapter (tokens unchanged), logprobs are the adapted model's
(transformers + peft's), n > 1 samples each run with the adapter, and structured output holds
an adapter's request to its schema."""
from __future__ import annotations

import json

import pytest

from kvrelay.engine import LLM, SamplingParams
from tests.conftest import reference_logprobs
from tests.lora.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _llm(lora_adapters, **kwargs) -> LLM:
    return LLM(dtype="float32", kv_cache_memory=128 << 20, enable_lora=True,
               lora_modules={name: path for name, (path, _) in lora_adapters.items()}, **kwargs)


@pytest.fixture(scope="module")
def llm(lora_adapters):
    return _llm(lora_adapters)


def test_speculative_decoding_verifies_with_the_adapter(lora_adapters, lora_prompts,
                                                         lora_references):
    llm = _llm(lora_adapters, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1,
                                                  "prompt_lookup_max": 3})
    names = ["all-r8", "o-down-r4", None]
    outputs = llm.generate([{"prompt_token_ids": lora_prompts[0]}] * 3, GREEDY, use_tqdm=False,
                           lora=names)
    assert [list(o.outputs[0].token_ids) for o in outputs] == \
        [lora_references[name][0] for name in names]
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0  # drafts were verified


def test_logprobs_are_the_adapted_models(llm, lora_adapters, lora_prompts, lora_references):
    prompt = lora_prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=0)
    [output] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                            lora="qv-r16-rs")
    completion = list(output.outputs[0].token_ids)
    assert completion == lora_references["qv-r16-rs"][0]
    expected = reference_logprobs(lora_adapters["qv-r16-rs"][1], prompt, completion)
    got = [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, completion)]
    want = [expected[index, token].item() for index, token in enumerate(completion)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_n_samples_each_run_with_the_adapter(llm, lora_prompts, lora_references):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, n=3)
    [output] = llm.generate({"prompt_token_ids": lora_prompts[1]}, params, use_tqdm=False,
                            lora="o-down-r4")
    assert [list(sample.token_ids) for sample in output.outputs] == \
        [lora_references["o-down-r4"][1]] * 3


def test_structured_output_with_an_adapter(llm, lora_prompts):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema})
    [output] = llm.generate({"prompt_token_ids": lora_prompts[0]}, params, use_tqdm=False,
                            lora="all-r8")
    assert set(json.loads(output.outputs[0].text)) == {"answer"}
