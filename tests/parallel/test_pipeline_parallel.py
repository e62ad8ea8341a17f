"""Pipeline parallelism, offline, float32: a model's layers split into 2 (or 3) stages, each its
own process passing activations on torch.distributed (gloo), gives the single process's greedy
tokens and its prompt logprobs within 1e-4: Llama, Qwen3 (q/k norms, windows), Gemma 3 (local
and global layers in two KV groups, sandwich norms, soft-capping), Qwen3-MoE, a hand-given
partition, and the default model; in bf16 with the small steps on a GGUF's or a GPTQ
checkpoint's 4-bit blocks. What cannot be split is refused."""
from __future__ import annotations

import gc

import pytest
from transformers import LlamaConfig

from kvrelay.engine import LLM
from kvrelay.engine.models.registry import arch_spec
from kvrelay.engine.parallel.partition import (balanced_counts, head_cost, layer_cost,
                                               stage_layers)
from kvrelay.engine.models import gguf_int4
from tests.families.checkpoints import CONFIGS, write_checkpoint, write_model
from tests.parallel.parity import assert_same, prompts_on, run_prompts
from tests.quantized.int4_writer import write_int4_checkpoint
from tests.quantized.test_int4_checkpoints import DIMS, FORMATS


@pytest.mark.parametrize("family,stages,partition", [
    ("llama3", 2, None), ("qwen3", 3, None), ("gemma3", 2, "4,2"), ("qwen3_moe", 2, "1,2")])
def test_staged_model_matches_one_process(family, stages, partition, tmp_path, model_dir):
    write_checkpoint(family, tmp_path, model_dir)
    assert_same(run_prompts(str(tmp_path)),
                run_prompts(str(tmp_path), pipeline_parallel_size=stages,
                            pp_layer_partition=partition))


def test_default_model_in_two_stages():
    assert_same(run_prompts(None), run_prompts(None, pipeline_parallel_size=2))


def test_stages_run_small_steps_on_the_checkpoints_4_bit_blocks(tmp_path, model_dir):
    """bf16: a stage's layers are whole, so its small steps multiply the 4-bit blocks of its
    own layers as one process does (the default model's GGUF, a GPTQ checkpoint): the same
    tokens and logprobs. The GPTQ checkpoint in float32 too (dequantized at load)."""
    if not gguf_int4.int4_supported():
        pytest.skip("no torch int4 CPU op")
    hf_model = write_model(LlamaConfig(**DIMS), tmp_path / "float", model_dir)
    write_int4_checkpoint(hf_model, FORMATS["gptq-sym-g32"], tmp_path / "int4", model_dir)
    for model, dtype in ((None, "bfloat16"), (str(tmp_path / "int4"), "bfloat16"),
                         (str(tmp_path / "int4"), "float32")):
        single = run_prompts(model, dtype, int4_max_tokens=4)
        staged = LLM(model=model, dtype=dtype, num_kv_blocks=256, int4_max_tokens=4,
                     pipeline_parallel_size=2)
        assert staged.engine.runner.uses_int4 == (dtype == "bfloat16")  # the first stage's
        assert_same(single, prompts_on(staged))
        del staged  # one split engine per process: its stages go before the next one's start
        gc.collect()


def test_the_default_split_balances_a_tokens_weights():
    """The first stage holds the head: on a small model it takes fewer layers (the default
    model's 30: 13 + 17)."""
    spec = arch_spec(CONFIGS["llama3"]())[1]
    assert [len(part) for part in stage_layers(spec, 2)] == [1, 1]
    assert [len(part) for part in stage_layers(_default_spec(), 2)] == [13, 17]
    costs = [10] * 30
    counts = balanced_counts(costs, 2, first_extra=80)
    assert counts == (11, 19) and sum(counts) == 30
    assert balanced_counts(costs, 3, first_extra=0) == (10, 10, 10)
    assert head_cost(spec) == spec.vocab_size * spec.hidden_size // 2 and layer_cost(spec, 0) > 0


def _default_spec():
    from transformers import AutoConfig

    from kvrelay.engine.model_loader import resolve_model_dir
    return arch_spec(AutoConfig.from_pretrained(resolve_model_dir(None)))[1]


@pytest.mark.parametrize("stages,partition,reason", [
    (3, None, "exceeds the model's 2 layers"), (2, "2,0", "summing to 2"),
    (2, "1,x", "comma-separated")])
def test_what_cannot_be_split_is_refused(stages, partition, reason, tmp_path, model_dir):
    write_checkpoint("llama3", tmp_path, model_dir)
    with pytest.raises(ValueError, match=reason):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64,
            pipeline_parallel_size=stages, pp_layer_partition=partition)


def test_tensor_and_pipeline_together_are_refused():
    with pytest.raises(ValueError, match="together are not served yet"):
        LLM(model=None, dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2,
            tensor_parallel_size=2)
