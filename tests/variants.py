"""Second variants of what `make test` already covers one way, run by `make test-variants`
(KVRELAY_VARIANTS=1): the suffix drafter where the n-gram one runs the same checks (the greedy
equality of both stays in make test), the 4-bit kernels other than the default one, a second
tool_choice form, the end-to-end twin of an offline preemption test, two topology changes the
chaos suite also exercises, the HF peer's harness, an engine parity run without prefix
caching, the 8-bit KV cache's fp8 parity and PD stack, LoRA on four more families, and tensor
parallel on Qwen2 and Mixtral (its experts split by columns and whole a rank) and a PD stack of
two rank groups. Each stays a test; make test's
time on 2 cores is what moves them here."""
from __future__ import annotations

import os

import pytest

VARIABLE = "KVRELAY_VARIANTS"
SPEC_SUFFIX = ("test_max_tokens_cuts_inside_an_accepted_run[suffix-{}]",
               "test_stop_strings_and_eos_inside_an_accepted_run[suffix]",
               "test_logprobs_are_those_of_the_emitted_tokens[suffix]",
               "test_penalties_bad_words_and_n_apply_at_every_verified_position[suffix]",
               "test_structured_output_checks_drafts_against_the_grammar[suffix]",
               "test_a_prompt_without_repetition_still_matches[suffix]")
E2E_SPEC_SUFFIX = ("test_grpc_greedy_equals_plain_decoding_and_drafts_are_accepted[suffix]",
                   "test_rest_streams_every_token_once_with_stop_strings_and_logprobs[suffix]",
                   "test_a_request_opts_out[suffix]", "test_every_block_is_free_afterwards[suffix]")
VARIANTS = frozenset(
    [f"tests/spec/test_speculative_greedy.py::{name.format(n)}"
     for name in SPEC_SUFFIX for n in ((1, 2, 7, 33) if "{}" in name else (None,))]
    + [f"tests/e2e/test_speculative.py::{name}" for name in E2E_SPEC_SUFFIX]
    + [f"tests/test_int4_weights.py::test_greedy_tokens_on_4_bit_weights_agree_with_the_float32_"
       f"reference[{kernel}]" for kernel in ("torch", "split", "int8")]
    + ["tests/e2e/test_structured_preemption.py::"
       "test_preempted_constrained_samples_match_the_offline_engine",
       "tests/e2e/test_tool_calls.py::"
       "test_required_and_named_calls_always_validate_streamed_or_not[tool_choice1]",
       "tests/e2e/test_topology.py::test_a_worker_started_mid_run_joins_its_group_and_takes_work",
       "tests/e2e/test_topology.py::test_a_worker_sent_sigterm_mid_run_drains_without_a_failed_"
       "request",
       "tests/bench/test_hf_static.py::"
       "test_static_batching_runs_without_kvrelay_on_the_written_conversations",
       "tests/families/test_family_gguf.py::test_q4_0_gguf_small_steps_run_on_its_own_blocks"
       "[gemma3]",
       # without prefix caching: test_batched_greedy_matches_hf's run, in two calls
       "tests/test_engine_parity.py::test_prefix_caching_with_shared_system_prompt[False]",
       # 8-bit KV: fp8 beside int8's teacher-forced run, and the PD stack beside the transports'
       # tests on 8-bit pages and the offline engine's
       "tests/test_kv_cache_8bit.py::test_greedy_tokens_agree_with_the_float_cache_teacher_"
       "forced[fp8_e4m3]",
       "tests/e2e/test_kv_cache_8bit_stack.py::"
       "test_pd_tokens_equal_the_offline_engine_on_the_same_8bit_cache",
       "tests/e2e/test_kv_cache_8bit_stack.py::test_each_worker_reports_its_kv_cache_dtype"]
    # LoRA on more families (make test keeps Qwen3 and Phi-3's fused projections), tensor
    # parallel with a Qwen2 (its biases: Llama and Qwen3 stay) and Mixtral (Qwen3-MoE stays)
    + [f"tests/lora/test_lora_families.py::test_family_adapter_matches_peft[{family}]"
       for family in ("gemma2", "gemma3", "mixtral", "qwen3_moe")]
    + [f"tests/parallel/test_tensor_parallel.py::test_split_model_matches_one_rank[{case}]"
       for case in ("qwen2_window-2", "mixtral-2")]
    + ["tests/parallel/test_tensor_parallel.py::test_whole_experts_a_rank_match_one_rank[mixtral]"]
    + ["tests/parallel/test_tp_stack.py::"
       "test_a_prefill_group_pushes_into_a_decode_worker_over_shared_memory[2]"])


def mark_variants(items) -> None:
    """Mark each variant `variant`; skip them unless $KVRELAY_VARIANTS is 1."""
    enabled = os.environ.get(VARIABLE) == "1"
    skip = pytest.mark.skip(reason=f"runs with `make test-variants` ({VARIABLE}=1)")
    for item in items:
        if item.nodeid in VARIANTS:
            item.add_marker(pytest.mark.variant)
            if not enabled:
                item.add_marker(skip)
