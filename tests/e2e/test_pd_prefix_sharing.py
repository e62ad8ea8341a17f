"""PD with prompts that share a prefix: the decode worker keeps one copy of the shared blocks,
whether they landed earlier (then they are not pushed again) or are still on their way (then
each transfer pushes them), and greedy output stays the offline engine's, token for token."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import chat_prompt_ids
from tests.e2e.grpc_api import generate, token_ids_request
from tests.e2e.stack import metric_values

MAX_TOKENS = 12
BLOCK_SIZE = 16  # the stack's default
SHARED_TOKENS = "kvrelay:kv_transfer_shared_prefix_tokens_total"
SYSTEM = ("You are the reference desk of a small maritime museum. Answer in one short sentence, "
          "name the exhibit room when it helps, and never invent opening hours. ")
QUESTIONS = ("Where is the lighthouse lens?", "Who built the oldest rowing boat here?",
             "Is there a knot-tying workshop?", "What does a sextant measure?")


@pytest.fixture(scope="module")
def cases(tokenizer, offline_llm) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the offline engine's greedy tokens) per question."""
    from kvrelay.engine import SamplingParams
    prompts = [chat_prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM * 3},
                                            {"role": "user", "content": question}])
               for question in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = offline_llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                                   use_tqdm=False)
    return [(ids, output.outputs[0].token_ids) for ids, output in zip(prompts, outputs)]


def _greedy(stack, prompt_ids: list[int]) -> list[int]:
    result = generate(stack.grpc_address, token_ids_request(
        prompt_ids, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return result.token_ids[0]


def _held_tokens(stack) -> float:
    return sum(metric_values(stack.service("scheduler")["metrics_url"], SHARED_TOKENS).values())


def test_shared_prefix_on_the_decode_worker_keeps_greedy_output(pd_stack, cases):
    with ThreadPoolExecutor(2) as pool:  # at once: the shared blocks are in flight together
        first = list(pool.map(lambda case: _greedy(pd_stack, case[0]), cases[:2]))
    assert first == [tokens for _, tokens in cases[:2]]
    held_after_first = _held_tokens(pd_stack)
    second = [_greedy(pd_stack, ids) for ids, _ in cases[2:]]  # the prefix has landed by now
    assert second == [tokens for _, tokens in cases[2:]]
    # Each of the later two found the shared prefix's full blocks on the decode worker.
    shared_blocks = len(os.path.commonprefix([ids for ids, _ in cases])) // BLOCK_SIZE
    assert shared_blocks >= 4
    assert _held_tokens(pd_stack) - held_after_first == 2 * shared_blocks * BLOCK_SIZE
    stats = pd_stack.scheduler_stats()
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers), stats
