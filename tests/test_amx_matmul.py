"""AMX matmuls (kernels/native_amx.py): the bf16 kernel against the float32 product of the same
weights on fresh random inputs, the 4-bit kernel bit-equal to the bf16 kernel on the weights it
widens to, and the engine's greedy tokens with small steps on AMX against HF transformers'
float32 model of the same (dequantized) weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, quantize

from kvrelay.kernels import native_amx
from kvrelay.engine import LLM, SamplingParams
from kvrelay.engine.models import gguf_int4
from tests.conftest import reference_logprobs
from tests.prompts import chat_conversations

pytestmark = pytest.mark.skipif(native_amx.amx_ops() is None, reason="no AMX-BF16 on this CPU")

# row counts around the kernel's 16-row tiles and 32-row blocks
ROW_COUNTS = (1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 100)


def q4_blocks(kind: str, out_features: int, in_features: int) -> gguf_int4.Q4Blocks:
    rng = np.random.default_rng()
    raw = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05,
                   GGMLQuantizationType[kind])
    return gguf_int4.unpack_blocks(kind, raw, in_features)


@pytest.mark.parametrize("shape", [(64, 32), (96, 576), (576, 1536)])
def test_bf16_kernel_matches_the_float32_product(shape):
    out_features, in_features = shape
    ops = native_amx.amx_ops()
    weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    packed = native_amx.pack_bf16(weight)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features).bfloat16()
        reference = x.float() @ weight.float().T
        got = native_amx.matmul_bf16(ops, x, packed)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        # float32 accumulation, one bf16 rounding of the result
        tolerance = 2 ** -7 * reference.abs() + 1e-3 * reference.abs().max()
        assert torch.all((got.float() - reference).abs() <= tolerance), rows


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_4_bit_kernel_equals_the_bf16_kernel_on_the_dequantized_weights(kind):
    ops = native_amx.amx_ops()
    blocks = q4_blocks(kind, 96, 1536)
    tiles = native_amx.pack_q4(blocks.q, blocks.scale, blocks.zero)
    packed = native_amx.pack_bf16(blocks.dequantized().bfloat16())  # the model's bf16 copy
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 1536).bfloat16()
        assert torch.equal(native_amx.matmul_q4(ops, x, tiles),
                           native_amx.matmul_bf16(ops, x, packed)), rows


def test_unsupported_shapes_are_refused():
    ops = native_amx.amx_ops()
    assert not native_amx.shape_supported(48, 64) and not native_amx.shape_supported(64, 48)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.gemm_bf16(torch.empty(1, 48, dtype=torch.bfloat16),
                      torch.ones(1, 64, dtype=torch.bfloat16),
                      torch.ones(48 * 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.gemm_bf16(torch.empty(1, 64, dtype=torch.bfloat16),
                      torch.ones(1, 64, dtype=torch.bfloat16),
                      torch.ones(32 * 64, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def amx_llm():
    llm = LLM(dtype="bfloat16", int4_max_tokens=0, amx_max_tokens=32)
    assert llm.engine.runner.uses_amx
    return llm


def test_batched_greedy_tokens_on_amx_agree_with_the_float32_reference(amx_llm, hf_model,
                                                                       tokenizer, monkeypatch):
    """All 16 prompts at once, so decode steps have 16 rows: every layer matmul on the 4-bit
    tiles and the head on the bf16 tiles. Teacher-forced against HF float32 as in
    test_int4_weights.py: a token that differs must be a near-tie. (oneDNN's bf16 path
    measured 378 of these 384 tokens, the AMX path the same 378.)"""
    calls = {"q4": 0, "bf16": 0}
    for kind in calls:
        kernel = getattr(native_amx, f"matmul_{kind}")

        def counted(*args, _kernel=kernel, _kind=kind):
            calls[_kind] += 1
            return _kernel(*args)
        monkeypatch.setattr(native_amx, f"matmul_{kind}", counted)
    prompts = []
    for with_system in (False, True):
        for conversation in chat_conversations(with_system=with_system):
            prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                   tokenize=True)
            prompts.append(list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outputs = amx_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    assert calls["q4"] > 0 and calls["bf16"] > 0, calls
    agree = total = 0
    margins = []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0].token_ids
        reference = reference_logprobs(hf_model, prompt, completion)  # [generated, vocab]
        for position, token_id in enumerate(completion):
            total += 1
            agree += int(reference[position].argmax().item() == token_id)
            margins.append(reference[position].max().item() - reference[position, token_id].item())
    assert agree >= 0.97 * total, f"{agree} of {total} tokens agree"
    assert max(margins) < 0.25, f"a token {max(margins):.3f} nats below the reference's best"
