"""POST /v1/embeddings through the PD stack (float32) with the openai SDK: a batch of texts of
mixed lengths and token-id inputs, float and base64, each equal to transformers' last hidden
state pooled as the gateway's --pooling says (last token, by default) and normalized (1e-5);
usage counts the prompt tokens; bad inputs are 400s naming the field; and the public gRPC API's
Embed gives the same vectors."""
from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import pytest
import torch

from kvrelay.api.kvrelay.v1 import generation_pb2, generation_pb2_grpc
from tests.prompts import USER_MESSAGES

TEXTS = ["Hi", USER_MESSAGES[0], " ".join(USER_MESSAGES[:4])]


@pytest.fixture(scope="module")
def hf_base(model_dir):
    from transformers import AutoModel
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_last(hf_base, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        hidden = hf_base(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


def test_texts_and_token_ids_float_and_base64(pd_client, model_id, tokenizer, hf_base):
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    floats = pd_client.embeddings.create(model=model_id, input=TEXTS)
    assert [item.index for item in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for item, prompt in zip(floats.data, ids):
        np.testing.assert_allclose(item.embedding, hf_last(hf_base, prompt), atol=1e-5)
    by_ids = pd_client.embeddings.create(model=model_id, input=ids[1:])
    packed = pd_client.embeddings.create(model=model_id, input=TEXTS, encoding_format="base64")
    for item, expected in zip(by_ids.data, floats.data[1:]):
        np.testing.assert_allclose(item.embedding, expected.embedding, atol=1e-6)
    for item, expected in zip(packed.data, floats.data):  # float32 little-endian, as OpenAI's
        raw = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
        # (a second request: the prefix cache changes the shapes the prompt is computed in)
        np.testing.assert_allclose(raw, expected.embedding, atol=1e-6)
    one = pd_client.embeddings.create(model=model_id, input=ids[0])
    np.testing.assert_allclose(one.data[0].embedding, floats.data[0].embedding, atol=1e-6)


def test_raw_base64_is_float32_little_endian(pd_stack, model_id):
    with httpx.Client(base_url=pd_stack.base_url, timeout=60, trust_env=False) as client:
        body = client.post("/embeddings", json={"input": "Hi", "encoding_format": "base64",
                                                "model": model_id}).json()
        plain = client.post("/embeddings", json={"input": "Hi", "model": model_id}).json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert raw.shape == (len(plain["data"][0]["embedding"]),)
    np.testing.assert_allclose(raw, plain["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[]]}, "input"),
    ({"input": "Hi", "dimensions": 7}, "dimensions"),
    ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "Hi", "unknown": 1}, "unknown"), ({"input": [-1]}, "input"),
])
def test_bad_requests_name_the_field(pd_stack, body, param):
    with httpx.Client(base_url=pd_stack.base_url, timeout=60, trust_env=False) as client:
        reply = client.post("/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_grpc_embed(pd_stack, pd_client, model_id):
    expected = pd_client.embeddings.create(model=model_id, input=TEXTS[:2])
    with grpc.insecure_channel(pd_stack.grpc_address) as channel:
        reply = generation_pb2_grpc.GenerationStub(channel).Embed(
            generation_pb2.EmbedRequest(texts=TEXTS[:2]), timeout=60)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    for vector, item in zip(reply.embeddings, expected.data):
        np.testing.assert_allclose(list(vector.values), item.embedding, atol=1e-6)
