"""Each family served by `kvrelay up --model DIR` in the default PD topology (KV pages pushed
from the prefill worker to the decode worker): greedy float32 tokens through the openai SDK equal
transformers', for prompts longer than the window, the second time from the prefix cache
(token ids over gRPC; the same text through the openai SDK)."""
from __future__ import annotations

import openai
import pytest
import torch

from tests.e2e.grpc_api import generate, token_ids_request
from tests.e2e.stack import start_stack, stop_and_check
from tests.families.checkpoints import CONFIGS, write_checkpoint

NEW_TOKENS = 64
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 8, [1, 42, 7] * 21]


@pytest.mark.family_stack
@pytest.mark.parametrize("stack_family", sorted(CONFIGS))
def test_pd_stack_greedy_matches_hf(tmp_path, model_dir, stack_family):
    folder = tmp_path / "model"
    hf_model = write_checkpoint(stack_family, folder, model_dir)
    stack = start_stack("pd", tmp_path / "stack", "--model", str(folder), num_kv_blocks=256)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0,
                               timeout=300)
        model = client.models.list().data[0].id
        for prompt in PROMPTS + PROMPTS[:1]:  # the repeat is served from the prefix cache
            with torch.inference_mode():
                expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                             min_new_tokens=NEW_TOKENS, do_sample=False)
            expected = expected[0, len(prompt):].tolist()
            result = generate(stack.grpc_address, token_ids_request(
                prompt, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
            assert result.token_ids[0] == expected, stack_family
            completion = client.completions.create(
                model=model, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                extra_body={"ignore_eos": True})
            assert completion.choices[0].text == result.text[0], stack_family
    finally:
        stop_and_check(stack)
