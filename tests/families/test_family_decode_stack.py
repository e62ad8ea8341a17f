"""The native decode stack runs every dense family's layer (bf16, from the checkpoint's own bf16
weights in the gemv kernel's tiles): its greedy tokens and logprobs equal the layer-by-layer
path's bit for bit, with windows, soft-capping, sandwich and 1 + w norms, q/k norms and biases;
a mixture-of-experts model keeps the layer-by-layer path."""
from __future__ import annotations

import pytest

from kvrelay.engine import LLM, SamplingParams
from tests.families.checkpoints import write_checkpoint

DENSE = ("qwen3", "gemma2", "gemma3", "qwen2_window", "mistral_window")
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 6, [1, 42, 7, 42, 7] * 9, [1, 8, 300, 4000]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, model_dir):
    paths = {}
    for name in DENSE + ("qwen3_moe",):
        paths[name] = tmp_path_factory.mktemp(name)
        write_checkpoint(name, paths[name], model_dir)
    return paths


def _generate(llm: LLM, batch: int):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:batch]],
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                          logprobs=3), use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(step.items()) for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("family", DENSE)
def test_the_stack_gives_the_layer_by_layer_tokens_and_logprobs(folders, family):
    # no prefix cache: the second pass recomputes its prompts as the first did
    llm = LLM(model=str(folders[family]), dtype="bfloat16", num_kv_blocks=96,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    if not runner.bf16_gemv:
        pytest.skip("no native gemv kernel here (needs AVX512-BF16 and a compiler)")
    stack = runner.model.decode_stack
    assert runner.decode_stack and stack is not None
    calls = []
    original = stack.run
    stack.run = lambda *args: calls.append(1) or original(*args)
    with_stack = [_generate(llm, 1), _generate(llm, 3)]  # steps of 1 and of 3 rows
    assert calls
    runner.model.decode_stack = None
    layered = [_generate(llm, 1), _generate(llm, 3)]
    assert with_stack == layered


def test_experts_keep_the_layer_by_layer_path(folders):
    runner = LLM(model=str(folders["qwen3_moe"]), dtype="bfloat16", num_kv_blocks=64).engine.runner
    assert runner.model.decode_stack is None and not runner.decode_stack
