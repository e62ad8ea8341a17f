"""Embeddings in the offline engine (pooling of the decoder's final hidden state, after its last
norm, L2-normalized), float32, against transformers' last_hidden_state pooled the same way: the
last token's or the mean of every token's (1e-5); the same alone or in a batch, in one chunk or
several, with the prompt's prefix cached or not."""
from __future__ import annotations

import pytest
import torch

from kvrelay.engine import LLM
from tests.prompts import USER_MESSAGES

TEXTS = ["Hello", "The capital of France is Paris.", *USER_MESSAGES[:3],
         " ".join(USER_MESSAGES[3:6])]


@pytest.fixture(scope="module")
def hf_base(model_dir):
    from transformers import AutoModel
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def token_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def hf_embedding(hf_base, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_base(torch.tensor([ids])).last_hidden_state[0].float()  # [T, hidden]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory=64 << 20)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled(llm, hf_base, token_ids, pooling):
    prompts = [{"prompt_token_ids": ids} for ids in token_ids]
    batch = llm.embed(prompts, pooling=pooling)
    for ids, output in zip(token_ids, batch):
        expected = hf_embedding(hf_base, ids, pooling)
        assert len(output.outputs.embedding) == expected.shape[0]
        assert torch.tensor(output.outputs.embedding) == pytest.approx(expected, abs=1e-5)
        assert output.prompt_token_ids == ids
    again = llm.embed(prompts, pooling=pooling)  # every prefix is cached now
    alone = [llm.embed([prompt], pooling=pooling)[0] for prompt in prompts[:3]]
    for first, second in zip(batch, again):
        assert torch.tensor(second.outputs.embedding) == pytest.approx(torch.tensor(first.outputs.embedding),
                                                               abs=1e-6)
    for first, single in zip(batch, alone):
        assert torch.tensor(single.outputs.embedding) == pytest.approx(torch.tensor(first.outputs.embedding),
                                                               abs=1e-6)


def test_chunked_prompts_pool_the_same(hf_base, token_ids):
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=16,
              long_prefill_token_threshold=16)
    longest = max(token_ids, key=len)
    assert len(longest) > 32
    for pooling in ("last", "mean"):
        [output] = llm.embed([{"prompt_token_ids": longest}], pooling=pooling)
        assert torch.tensor(output.outputs.embedding) == pytest.approx(
            hf_embedding(hf_base, longest, pooling), abs=1e-5)


def test_bad_pooling_is_refused(llm):
    with pytest.raises(ValueError, match="pooling"):
        llm.embed(["Hi"], pooling="cls")
