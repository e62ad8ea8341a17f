"""Tensor parallelism, offline, float32: a model split over 2 (or 3, or 4) ranks, each its own
process on torch.distributed (gloo), gives the single rank's greedy tokens and its prompt
logprobs within 1e-4, for Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms, windows), Phi-3 (fused
q/k/v and gate/up in the checkpoint), Qwen3-MoE and Mixtral (each expert split by its
intermediate columns, or expert parallel: whole experts a rank), K/V heads replicated where
ranks outnumber them, and the default model split three ways (9 query and 3 KV heads). What
cannot be split is refused."""
from __future__ import annotations

import dataclasses

import pytest

from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.models.registry import arch_spec
from kvrelay.engine.parallel.shard import check_shardable
from tests.families.checkpoints import CONFIGS, write_checkpoint
from tests.parallel.parity import PROMPTS, assert_same, prompts_on, run_prompts


@pytest.mark.parametrize("family,size", [("llama3", 2), ("llama3", 4), ("qwen2_window", 2),
                                         ("qwen3", 2), ("phi3_window", 2), ("qwen3_moe", 2),
                                         ("mixtral", 2)])
def test_split_model_matches_one_rank(family, size, tmp_path, model_dir):
    write_checkpoint(family, tmp_path, model_dir)
    assert_same(run_prompts(str(tmp_path)), run_prompts(str(tmp_path), tensor_parallel_size=size))


def test_default_model_three_ways():
    assert_same(run_prompts(None), run_prompts(None, tensor_parallel_size=3))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_whole_experts_a_rank_match_one_rank(family, tmp_path, model_dir):
    """Expert parallel: each of 2 ranks holds half the experts whole (Qwen3-MoE 4 of 8,
    Mixtral 2 of 4) and adds their share of each token's sum."""
    write_checkpoint(family, tmp_path, model_dir)
    single = run_prompts(str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
              enable_expert_parallel=True)
    experts = arch_spec(CONFIGS[family]())[1].moe.num_experts
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers
               if hasattr(layer.mlp, "experts"))
    assert moe.experts.w13.shape[0] == experts // 2 and moe.gate.out_features == experts
    assert_same(single, prompts_on(llm))


def test_expert_parallel_that_cannot_be_made_is_refused(tmp_path, model_dir):
    spec = arch_spec(CONFIGS["qwen3_moe"]())[1]
    check_shardable(spec, 2, expert_parallel=True)
    five = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, num_experts=5))
    with pytest.raises(ValueError, match="does not divide the model's experts"):
        check_shardable(five, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        check_shardable(arch_spec(CONFIGS["llama3"]())[1], 2, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(model=None, dtype="float32", num_kv_blocks=16, enable_expert_parallel=True)


def test_experts_that_do_not_split_are_refused():
    config = CONFIGS["qwen3_moe"]()
    spec = arch_spec(config)[1]
    odd = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate_size=33))
    check_shardable(spec, 2)
    with pytest.raises(ValueError, match="experts' intermediate size"):
        check_shardable(odd, 2)


@pytest.mark.parametrize("family,size,reason", [("llama3", 3, "does not divide")])
def test_what_cannot_be_split_is_refused(family, size, reason, tmp_path, model_dir):
    write_checkpoint(family, tmp_path, model_dir)
    with pytest.raises(ValueError, match=reason):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=size)


def _second_token_logprobs(llm: LLM) -> list[dict[int, float]]:
    """The first decode step's top logprobs per prompt (the prefill before it runs the same
    GEMMs whatever the small-step kernels)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                          logprobs=5), use_tqdm=False)
    return [{token: entry.logprob for token, entry in output.outputs[0].logprobs[1].items()}
            for output in outputs]


def test_a_bf16_shard_runs_its_small_steps_on_the_gemv_kernel(tmp_path, model_dir):
    """A rank's decode steps multiply its own shard's bf16 tiles (the 4-bit blocks of a GGUF
    would be whole weights), never the one-call decode stack (it cannot sum across ranks): the
    logprobs agree with the same split on oneDNN within bf16's rounding."""
    write_checkpoint("llama3", tmp_path, model_dir)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=64, tensor_parallel_size=2)
    runner = llm.engine.runner
    if not runner.bf16_gemv:
        pytest.skip("no native gemv kernel here (needs AVX512-BF16 and a compiler)")
    assert runner.model.decode_stack is None and not runner.decode_stack
    on_gemv = _second_token_logprobs(llm)
    del llm, runner
    on_onednn = _second_token_logprobs(LLM(model=str(tmp_path), dtype="bfloat16",
                                           num_kv_blocks=64, tensor_parallel_size=2,
                                           int4_max_tokens=0))
    for gemv, onednn in zip(on_gemv, on_onednn):
        shared = set(gemv) & set(onednn)
        assert len(shared) >= 3
        assert max(abs(gemv[token] - onednn[token]) for token in shared) < 0.05
