"""What the offline split-model tests share: three prompts, greedy tokens with prompt logprobs,
and the comparison against one process (the same tokens, logprobs within 1e-4)."""
from __future__ import annotations

from kvrelay.engine import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 200, 3000, 17] * 7, [1, 42, 7] * 20, [1] + list(range(100, 230, 3))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)


def run_prompts(model: str | None, dtype: str = "float32", **engine_args):
    """(greedy tokens, prompt logprobs) per prompt."""
    return prompts_on(LLM(model=model, dtype=dtype, num_kv_blocks=256, **engine_args))


def prompts_on(llm: LLM):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [[entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:],
                                                                 prompt[1:])]
                for output, prompt in zip(outputs, PROMPTS)]
    return tokens, logprobs


def assert_same(single, split) -> None:
    assert split[0] == single[0]
    worst = max(abs(a - b) for one, other in zip(single[1], split[1]) for a, b in zip(one, other))
    assert worst < 1e-4, worst
