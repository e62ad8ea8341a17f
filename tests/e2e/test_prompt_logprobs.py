"""Prompt logprobs through both topologies (float32 stacks; in PD the prefill worker computes
them): vLLM's prompt_logprobs on completions and chat, echo with logprobs on completions
(streamed or not), and the public gRPC API, each equal to transformers' log-softmax of the
prompt positions (1e-4), also right after the same prompt was cached (no hit shortens it)."""
from __future__ import annotations

import pytest
import torch

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import chat_prompt_ids, openai_client
from tests.prompts import USER_MESSAGES

import grpc

TOP = 3


@pytest.fixture(params=["pd", "colocated"])
def stack(request):
    return request.getfixturevalue(f"{request.param}_stack")


@pytest.fixture(scope="module")
def case(tokenizer, hf_model):
    messages = [{"role": "user", "content": USER_MESSAGES[1]}]
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return messages, prompt_ids, logits[:-1].log_softmax(-1)  # row i predicts token i + 1


def check_vllm_form(entries: list, prompt_ids: list[int], reference: torch.Tensor) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row, token = reference[position - 1], prompt_ids[position]
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert set(map(int, entry)) == set(row.topk(TOP).indices.tolist()) | {token}


def test_completions_and_chat_prompt_logprobs(stack, case):
    messages, prompt_ids, reference = case
    client = openai_client(stack)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt=prompt_ids, max_tokens=1)  # now cached
    for _ in range(2):
        completion = client.completions.create(model=model, prompt=prompt_ids, max_tokens=2,
                                               temperature=0,
                                               extra_body={"prompt_logprobs": TOP})
        check_vllm_form(completion.choices[0].model_extra["prompt_logprobs"], prompt_ids,
                        reference)
        assert completion.usage.prompt_tokens_details.cached_tokens == 0
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": TOP})
    check_vllm_form(chat.model_extra["prompt_logprobs"], prompt_ids, reference)
    streamed = [chunk.model_extra["prompt_logprobs"] for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0, stream=True,
        extra_body={"prompt_logprobs": TOP}) if "prompt_logprobs" in (chunk.model_extra or {})]
    assert streamed == [chat.model_extra["prompt_logprobs"]]
    plain = client.completions.create(model=model, prompt=prompt_ids, max_tokens=2)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


def test_echo_with_logprobs_scores_the_prompt(stack, case, tokenizer):
    _, prompt_ids, reference = case
    client = openai_client(stack)
    model = client.models.list().data[0].id
    args = dict(model=model, prompt=prompt_ids, max_tokens=3, temperature=0, echo=True,
                logprobs=1)
    choice = client.completions.create(**args).choices[0]
    echo = tokenizer.decode(prompt_ids)
    assert choice.text.startswith(echo)
    lists = choice.logprobs
    assert len(lists.tokens) == len(prompt_ids) + 3
    assert lists.token_logprobs[0] is None and lists.top_logprobs[0] is None
    expected = [reference[position - 1, prompt_ids[position]].item()
                for position in range(1, len(prompt_ids))]
    assert lists.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected, abs=1e-4)
    assert "".join(lists.tokens[:len(prompt_ids)]) == echo
    assert lists.text_offset[len(prompt_ids)] == len(echo)
    streamed = {"text": "", "tokens": [], "token_logprobs": []}
    for chunk in client.completions.create(stream=True, **args):
        streamed["text"] += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            streamed["tokens"] += chunk.choices[0].logprobs.tokens
            streamed["token_logprobs"] += chunk.choices[0].logprobs.token_logprobs
    assert streamed == {"text": choice.text, "tokens": lists.tokens,
                        "token_logprobs": lists.token_logprobs}


def test_grpc_prompt_logprobs(stack, case):
    _, prompt_ids, reference = case
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt_ids),
        params=common_pb2.SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP))
    entries = []
    with grpc.insecure_channel(stack.grpc_address) as channel:
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request,
                                                                             timeout=120):
            for choice in response.choices:
                entries += choice.prompt_logprobs
    assert [entry.token_id for entry in entries] == prompt_ids[1:]
    assert [entry.logprob for entry in entries] == pytest.approx(
        [reference[position - 1, prompt_ids[position]].item()
         for position in range(1, len(prompt_ids))], abs=1e-4)
    assert all(len(entry.top) == TOP for entry in entries)
