"""The engine's features on the new families (offline, float32): speculative decoding gives the
plain greedy tokens, structured output holds, logprobs and n > 1 come back, a preempted and
recomputed request ends as it would have."""
from __future__ import annotations

import re

import pytest

from kvrelay.engine import LLM, SamplingParams
from tests.families.checkpoints import write_checkpoint

FAMILIES = ("gemma3", "qwen3_moe", "phi3_window")
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 6, [1, 42, 7, 42, 7] * 9]


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(request.param, path, model_dir)
    return path


def _greedy(llm: LLM, prompts=PROMPTS, **params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                          **params), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def test_speculative_and_preempted_runs_give_the_plain_tokens(folder):
    reference = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    plain = _greedy(reference)
    # The prompt's end also occurs earlier in it, followed by the model's own continuation:
    # the n-gram drafter proposes that continuation, so verification runs.
    echoing = [PROMPTS[0] + plain[0] + PROMPTS[0]]
    speculative = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5})
    assert _greedy(speculative, echoing) == _greedy(reference, echoing)
    assert speculative.engine.spec_decode_stats.num_draft_tokens > 0
    # Room for one request's tokens in every KV group, not for both: with full attention one is
    # preempted and recomputed; window groups keep so few blocks that the second may only wait.
    layout = reference.engine.runner.kv_layout
    tight = LLM(model=str(folder), dtype="float32", num_kv_blocks=layout.num_groups * 5 + 2)
    assert _greedy(tight) == plain
    if not any(layout.windows):
        assert tight.engine.scheduler.stats.num_preemptions > 0


def test_structured_output_logprobs_and_samples(folder):
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.8, max_tokens=12, n=2, logprobs=2, seed=7,
                            structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"})
    output = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert len(output.outputs) == 2
    for sample in output.outputs:
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", sample.text), sample.text
        assert len(sample.logprobs) == len(sample.token_ids)
