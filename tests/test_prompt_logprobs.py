"""Prompt logprobs (vLLM's prompt_logprobs) in the offline engine, float32, against transformers'
log-softmax of the prompt positions: every token's logprob (1e-4), its rank and the top-k; the
same whether the prompt is one chunk or several, and whether or not its prefix is cached."""
from __future__ import annotations

import pytest
import torch

from kvrelay.engine import LLM, SamplingParams
from tests.prompts import USER_MESSAGES

TOP = 5


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
             for text in USER_MESSAGES[:3]]
    return [tokenizer(text)["input_ids"] for text in texts]


def hf_prompt_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return logits[:-1].log_softmax(-1)  # [len - 1, vocab]: row i predicts token i + 1


def check(output, reference: torch.Tensor, prompt_ids: list[int]) -> None:
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row, token = reference[position - 1], prompt_ids[position]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_ids = row.topk(TOP).indices.tolist()
        assert set(entry) == set(top_ids) | {token}
        for rank, top_id in enumerate(top_ids, start=1):
            assert entry[top_id].logprob == pytest.approx(row[top_id].item(), abs=1e-4)
            if top_id != token:
                assert entry[top_id].rank == rank


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_equal_transformers(hf_model, prompts, chunk):
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=chunk,
              long_prefill_token_threshold=chunk if chunk < 2048 else 0)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP)
    first = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    # again: the prompts' blocks are cached now, and must not shorten what is computed
    second = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out_first, out_second in zip(prompts, first, second):
        check(out_first, hf_prompt_logprobs(hf_model, ids), ids)
        assert out_second.num_cached_tokens == 0
        assert [None if e is None else {k: v.logprob for k, v in e.items()}
                for e in out_second.prompt_logprobs] == \
            [None if e is None else {k: v.logprob for k, v in e.items()}
             for e in out_first.prompt_logprobs]
    plain = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(max_tokens=2, temperature=0))
    assert plain[0].prompt_logprobs is None


def test_zero_alternatives_and_bad_values():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
