"""LoRA adapters through the PD stack (`kvrelay up --enable-lora`), float32: a request names an
adapter as its model and gets transformers + peft's greedy tokens, in a mix of adapters and the
base running at once; adapters load and unload at run time behind the API key while streams
on the others keep their exact texts; unknown adapters are 404 model_not_found; bad ones are
refused with the reason and nothing running is hurt."""
from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import openai
import pytest

from kvrelay.api.kvrelay.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.grpc_api import Generated, token_ids_request
from tests.e2e.stack import metric_values, start_stack, stop_and_check
from tests.lora.conftest import MAX_NEW_TOKENS

API_KEY = "lora-admin-key"
STARTED_WITH = ("all-r8", "qv-r16-rs")
METADATA = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory, lora_adapters):
    modules = ",".join(f"{name}={lora_adapters[name][0]}" for name in STARTED_WITH)
    stack = start_stack("pd", tmp_path_factory.mktemp("lora-stack"), "--enable-lora",
                        "--max-loras", "2", "--lora-modules", modules, "--api-key", API_KEY)
    yield stack
    stop_and_check(stack)


@pytest.fixture(scope="module")
def client(lora_stack):
    return openai.OpenAI(base_url=lora_stack.base_url, api_key=API_KEY, max_retries=0,
                         timeout=120)


def _generated(stack, model: str | None, prompt_ids: list[int]) -> Generated:
    """Greedy tokens and text through the gRPC API (model None: the base)."""
    request = token_ids_request(prompt_ids, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    request.model = model or ""
    result = Generated()
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(request, timeout=120, metadata=METADATA):
            for choice in response.choices:
                result.token_ids.setdefault(choice.index, []).extend(choice.token_ids)
                result.text[choice.index] = result.text.get(choice.index, "") + choice.text
    return result


def _tokens(stack, model: str | None, prompt_ids: list[int]) -> list[int]:
    return _generated(stack, model, prompt_ids).token_ids[0]


def test_models_lists_the_adapters_with_their_parent(client):
    cards = {card.id: card for card in client.models.list().data}
    base = next(card for card in cards.values() if card.parent is None)
    for name in STARTED_WITH:
        assert cards[name].parent == base.id


def test_mixed_requests_get_their_adapters_tokens(client, lora_stack, lora_prompts,
                                                  lora_references):
    """Adapters and the base at once, over REST and gRPC: each request its own reference."""
    jobs = [(name, index) for index in range(len(lora_prompts))
            for name in (*STARTED_WITH, None)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _generated(lora_stack, job[0],
                                                        lora_prompts[job[1]]), jobs))
    for (name, index), result in zip(jobs, results):
        assert result.token_ids[0] == lora_references[name][index], (name, index)
    rest = client.completions.create(model="qv-r16-rs", prompt=lora_prompts[0], temperature=0,
                                     max_tokens=MAX_NEW_TOKENS)
    assert rest.model == "qv-r16-rs"
    assert rest.choices[0].text == results[jobs.index(("qv-r16-rs", 0))].text[0]


def test_unknown_adapter_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-adapter", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"


def _admin(stack, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{stack.rest_url}{path}", json=body, headers=headers, timeout=300)


def test_load_use_unload_reload_under_load(client, lora_stack, lora_adapters, lora_prompts,
                                           lora_references):
    """16 streams on the adapters loaded at start keep their exact tokens while another is
    loaded, used, unloaded and loaded again."""
    streams = [(STARTED_WITH[i % 2], i % len(lora_prompts)) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        running = [pool.submit(_tokens, lora_stack, name, lora_prompts[index])
                   for name, index in streams]
        path = lora_adapters["o-down-r4"][0]
        assert _admin(lora_stack, "/v1/load_lora_adapter",
                      {"lora_name": "late", "lora_path": path}).status_code == 200
        assert _tokens(lora_stack, "late", lora_prompts[0]) == \
            lora_references["o-down-r4"][0]
        assert _admin(lora_stack, "/v1/unload_lora_adapter",
                      {"lora_name": "late"}).status_code == 200
        with pytest.raises(grpc.RpcError) as caught:
            _tokens(lora_stack, "late", lora_prompts[0])
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert _admin(lora_stack, "/v1/load_lora_adapter",
                      {"lora_name": "late", "lora_path": path}).status_code == 200
        assert _tokens(lora_stack, "late", lora_prompts[1]) == \
            lora_references["o-down-r4"][1]
        for (name, index), future in zip(streams, running):
            assert future.result() == lora_references[name][index]


def test_admin_calls_need_the_api_key(lora_stack, lora_adapters):
    body = {"lora_name": "sneaky", "lora_path": lora_adapters["all-r8"][0]}
    assert _admin(lora_stack, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert _admin(lora_stack, "/v1/load_lora_adapter", body, key="wrong").status_code == 401


def test_bad_adapter_refused_with_the_reason(client, lora_stack, lora_prompts, lora_references,
                                             tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "use_dora": true}')
    response = _admin(lora_stack, "/v1/load_lora_adapter",
                      {"lora_name": "dora", "lora_path": str(tmp_path)})
    assert response.status_code == 400
    assert "use_dora" in response.json()["error"]["message"]
    missing = _admin(lora_stack, "/v1/load_lora_adapter",
                     {"lora_name": "nowhere", "lora_path": str(tmp_path / "absent")})
    assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]
    assert "dora" not in {card.id for card in client.models.list().data}
    assert _tokens(lora_stack, "all-r8", lora_prompts[0]) == lora_references["all-r8"][0]


def test_unload_unknown_is_404(lora_stack):
    response = _admin(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_grpc_admin_calls(lora_stack, lora_adapters, lora_prompts, lora_references):
    metadata = METADATA
    with grpc.insecure_channel(lora_stack.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stub.LoadLoraAdapter(generation_pb2.LoadLoraAdapterRequest(
            lora_name="via-grpc", lora_path=lora_adapters["o-down-r4"][0]), metadata=metadata,
            timeout=300)
        models = stub.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata)
        assert "via-grpc" in {model.id for model in models.models}
        assert _tokens(lora_stack, "via-grpc", lora_prompts[0]) == \
            lora_references["o-down-r4"][0]
        stub.UnloadLoraAdapter(generation_pb2.UnloadLoraAdapterRequest(lora_name="via-grpc"),
                               metadata=metadata, timeout=300)
        with pytest.raises(grpc.RpcError) as caught:
            stub.UnloadLoraAdapter(generation_pb2.UnloadLoraAdapterRequest(
                lora_name="via-grpc"), metadata=metadata, timeout=300)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_scheduler_reports_lora_requests_info(lora_stack):
    scheduler = lora_stack.service("scheduler")
    info = metric_values(scheduler["metrics_url"], "kvrelay:lora_requests_info")
    assert info and all('max_lora="2"' in labels for labels in info)
