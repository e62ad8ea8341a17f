"""GGUF K-quants (gguf_int4.py): Q4_K blocks, written by the reference quantizer of
q4_k_writer.py in ggml's layout, unpack to what gguf itself dequantizes; a file that mixes them
with other types as llama.cpp's Q4_K_M does runs the small steps of the matmuls whose parts are
all 4-bit on those blocks and the others on the dequantized weights, and answers like
transformers' float32 model of the same file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, LlamaConfig

from kvrelay.engine import LLM
from kvrelay.engine.models import gguf_int4
from tests.families.checkpoints import write_model
from tests.families.gguf_writer import write_gguf
from tests.families.test_family_gguf import (PROMPTS, SMALL_STEPS_OFF, _check_against_reference,
                                             _check_same_until_a_near_tie, _greedy)
from tests.quantized.q4_k_writer import quantize_q4_k, reference_dequantize

pytestmark = pytest.mark.skipif(not gguf_int4.int4_supported(), reason="no torch int4 CPU op")

# rows of 256 and 512 inputs: whole Q4_K super-blocks
DIMS = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, num_hidden_layers=2, initializer_range=0.1,
            tie_word_embeddings=True)


def test_q4_k_blocks_unpack_to_what_gguf_dequantizes():
    rng = np.random.default_rng()
    weights = rng.standard_normal((48, 512)).astype(np.float32) * 0.05
    raw = quantize_q4_k(weights)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(expected, reference_dequantize(raw, 512))  # the writer's layout
    blocks = gguf_int4.unpack_blocks("Q4_K", raw, 512)
    assert blocks.q.min() >= 0 and blocks.q.max() <= 15
    # (q - 8) * scale + (8 * scale - dmin * m) against gguf's q * scale - dmin * m: the same
    # value, rounded twice instead of once
    torch.testing.assert_close(blocks.dequantized(), torch.from_numpy(expected), rtol=1e-6,
                               atol=1e-7)
    for num_tokens in (1, 3, 8):
        x = torch.randn(num_tokens, 512).bfloat16()
        reference = x.float() @ torch.from_numpy(expected).T
        got = blocks.to_torch().matmul(x).float()
        assert (got - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp("q4-k-m")
    hf_model = write_model(LlamaConfig(**DIMS), folder / "safetensors", model_dir)
    with pytest.MonkeyPatch.context() as patch:  # this module's conversion in its own cache
        patch.setenv("KVRELAY_CACHE_DIR", str(folder / "cache"))
        path = str(write_gguf(hf_model, folder / "q4_k_m.gguf", "Q4_K_MIX"))
        yield (LLM(model=path, dtype="bfloat16", num_kv_blocks=64),
               LLM(model=path, dtype="bfloat16", num_kv_blocks=64, **SMALL_STEPS_OFF))


def test_q4_k_matmuls_run_small_steps_on_their_blocks_and_the_rest_dequantized(q4_k_m):
    with_kernels, without = q4_k_m
    runner = with_kernels.engine.runner
    assert runner.uses_int4 and runner.int4_kernel == "torch"  # Q4_K scales are not float16
    assert not without.engine.runner.uses_int4
    for layer in runner.model.layers:
        # o and gate/up are all Q4_K; q/k/v hold a Q8_0 v, and down is Q8_0
        assert layer.self_attn.o_proj.small_steps and layer.mlp.gate_up_proj.small_steps
        assert not layer.self_attn.qkv_proj.small_steps and not layer.mlp.down_proj.small_steps
    hf_model = AutoModelForCausalLM.from_pretrained(with_kernels.engine.model_dir,
                                                    dtype=torch.float32).eval()
    for together in (False, True):
        on, off = _greedy(with_kernels, PROMPTS, together), _greedy(without, PROMPTS, together)
        label = f"Q4_K_M, {'together' if together else 'alone'}"
        _check_against_reference(hf_model, PROMPTS, on, f"{label}, kernels on")
        for prompt, on_out, off_out in zip(PROMPTS, on, off):
            _check_same_until_a_near_tie(hf_model, prompt, on_out, off_out, label)
