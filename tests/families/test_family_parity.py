"""Every family against transformers in float32, on tiny random checkpoints: teacher-forced
logits of a prompt plus HF's continuation within 1e-4, and greedy tokens identical for 64
generated tokens over prompts longer than the window, through the offline engine."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.model_runner import ModelRunner, StepInput
from tests.conftest import below_best, reference_logprobs
from tests.families.checkpoints import CONFIGS, WINDOW, write_checkpoint

NEW_TOKENS = 64
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 7, [1, 42, 7] * 20, [1] + list(range(100, 230, 3))]
assert all(len(prompt) > 2 * WINDOW for prompt in PROMPTS)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, write_checkpoint(request.param, folder, model_dir)


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False)
    return output[0, len(prompt):].tolist()


def _whole_sequence_logits(folder, token_ids: list[int]) -> torch.Tensor:
    """kvrelay's logits at every position of token_ids, in one prefill step: [T, vocab]."""
    config = AutoConfig.from_pretrained(folder)
    block_size, count = 16, len(token_ids)
    per_group = -(-count // block_size)
    runner = ModelRunner(config, folder, torch.float32, torch.device("cpu"), block_size,
                         4 * per_group * len(config.to_dict().get("layer_types") or [0]), 0)
    groups = range(runner.kv_layout.num_groups)  # each KV group its own blocks
    tables = [torch.arange(g * per_group, (g + 1) * per_group, dtype=torch.int32)[None]
              for g in groups]
    rows = torch.arange(count)
    step = StepInput(input_ids=torch.tensor(token_ids), positions=rows,
                     slot_mappings=[rows + g * per_group * block_size for g in groups],
                     cu_seqlens_q=torch.tensor([0, count], dtype=torch.int32),
                     seq_lens=torch.tensor([count], dtype=torch.int32), block_tables=tables,
                     logits_indices=rows, sample_rows=[0] * count, max_seqlen_q=count,
                     max_seqlen_k=count)
    return runner.execute(step)


def test_teacher_forced_logits_match_hf(family):
    name, folder, hf_model = family
    prompt = PROMPTS[0]
    token_ids = prompt + _hf_greedy(hf_model, prompt)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    got = _whole_sequence_logits(folder, token_ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=name)


def test_greedy_tokens_match_hf(family):
    name, folder, hf_model = family
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                          ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(hf_model, prompt), name


NEAR_TIE = 0.25  # nats; as tests/test_int4_weights.py


def test_bfloat16_fast_paths_answer_like_float32(family):
    """bf16 runs the fast CPU paths (packed matmuls and experts, native norms, rope and
    attention): every greedy token is HF float32's best given the same prefix, or a near-tie."""
    name, folder, hf_model = family
    llm = LLM(model=str(folder), dtype="bfloat16", num_kv_blocks=64)
    prompt = PROMPTS[1]
    got = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    reference = reference_logprobs(hf_model, prompt, got)
    gaps = below_best(reference, got)
    assert max(gaps) < NEAR_TIE, f"{name}: a token {max(gaps):.3f} nats below float32's best"
