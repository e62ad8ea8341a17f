"""The PD stack on an 8-bit KV cache (`kvrelay up --kv-cache-dtype int8`): the prefill worker
codes the prompt's K/V rows, the pages reach the decode worker through the shared-memory
transport as bytes, and greedy float32 tokens equal the offline engine's on the same cache
format (what a colocated worker computes), the repeat served from the prefix cache. Each
worker reports its cache's dtype in /metrics."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import MAX_NEW_TOKENS, openai_client
from tests.e2e.grpc_api import generate, token_ids_request
from tests.e2e.stack import metric_values, start_stack, stop_and_check


@pytest.fixture(scope="module")
def int8_stack(tmp_path_factory):
    stack = start_stack("pd", tmp_path_factory.mktemp("int8-kv-stack"), "--kv-cache-dtype", "int8")
    yield stack
    stop_and_check(stack)


def test_pd_tokens_equal_the_offline_engine_on_the_same_8bit_cache(int8_stack, greedy_cases):
    from kvrelay.engine import LLM, SamplingParams
    offline = LLM(dtype="float32", num_kv_blocks=512, kv_cache_dtype="int8")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    client = openai_client(int8_stack)
    model = client.models.list().data[0].id
    for case in greedy_cases + greedy_cases[:1]:  # the repeat reads the prefix cache's pages
        [expected] = offline.generate({"prompt_token_ids": case.prompt_ids}, params, use_tqdm=False)
        result = generate(int8_stack.grpc_address, token_ids_request(
            case.prompt_ids, temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
        assert result.token_ids[0] == expected.outputs[0].token_ids
        chat = client.chat.completions.create(model=model, messages=case.messages, temperature=0,
                                              max_tokens=MAX_NEW_TOKENS, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == result.text[0]


def test_each_worker_reports_its_kv_cache_dtype(int8_stack):
    for name, worker in int8_stack.workers().items():
        info = metric_values(worker["metrics_url"], "kvrelay:worker_model_info")
        assert [labels for labels in info if 'kv_cache_dtype="int8"' in labels], (name, info)
