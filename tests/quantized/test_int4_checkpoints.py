"""GPTQ and AWQ checkpoints (quant_schemes.py, int4_unpack.py, int4_checkpoint.py), written by the
reference quantizers of int4_writer.py in each format's own layout: kvrelay's dequantized weights
equal the reference's bit for bit, its 4-bit blocks multiply within bf16's bound of the float32
product, the engine's greedy tokens in float32 equal transformers' on the dequantized weights,
its bf16 small steps run on the checkpoint's codes and answer like the float32 reference, and a
quantization kvrelay does not run is refused at start with the reason."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from kvrelay.engine import LLM
from kvrelay.engine.models import gguf_int4
from kvrelay.engine.models.quant_schemes import scheme_of
from kvrelay.engine.models.int4_unpack import unpack
from kvrelay.kernels import native_gemv
from tests.families.checkpoints import write_model
from tests.families.test_family_gguf import (PROMPTS, _check_against_reference, _greedy,
                                             _hf_greedy)
from tests.quantized.int4_writer import LINEARS, Format, pack, quantize, write_int4_checkpoint

FORMATS = {
    "gptq-sym-g32": Format("gptq", 32, sym=True),
    "gptq-g64": Format("gptq", 64),
    "gptq-v2-g128": Format("gptq", 128, checkpoint_format="gptq_v2"),
    "gptq-act-order-g32": Format("gptq", 32, act_order=True),
    "gptq-act-order-sym-g128": Format("gptq", 128, sym=True, act_order=True),
    "gptq-per-row": Format("gptq", -1),
    "awq-g32": Format("awq", 32),
    "awq-g64": Format("awq", 64),
    "awq-g128": Format("awq", 128),
}
# 128 inputs everywhere, so group 128 fits every linear; weights larger than transformers'
# default initialisation, so greedy choices are rarely near-ties bf16 may flip
DIMS = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, num_hidden_layers=2, initializer_range=0.3)
# the checkpoints the engine runs: each method, with and without act-order, two families
CHECKPOINTS = {
    "llama-gptq-act-order": (lambda: LlamaConfig(**DIMS), "gptq-act-order-g32"),
    "qwen3-gptq-g128": (lambda: Qwen3Config(**DIMS, tie_word_embeddings=False), "gptq-v2-g128"),
    "llama-awq-g64": (lambda: LlamaConfig(**DIMS), "awq-g64"),
    "llama-gptq-sym-g32": (lambda: LlamaConfig(**DIMS), "gptq-sym-g32"),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_unpacked_weights_equal_the_reference_dequantization(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng()
    weight = torch.from_numpy(rng.standard_normal((48, 256)).astype(np.float32) * 0.05)
    quantized = quantize(weight, fmt, rng)
    scheme = scheme_of({"quantization_config": fmt.quantization_config()})
    int4 = unpack(scheme, "layers.0.mlp.down_proj", pack(quantized, fmt))
    reference = quantized.dequantized()
    torch.testing.assert_close(int4.dequantized(), reference, atol=0, rtol=0)
    blocks = int4.to_q4_blocks()
    assert (blocks.input_order is not None) == (fmt.act_order and fmt.group_size != -1)
    torch.testing.assert_close(blocks.dequantized(), reference, atol=0, rtol=0)
    if gguf_int4.int4_supported():
        for num_tokens in (1, 3, 8):
            x = torch.randn(num_tokens, 256).bfloat16()
            expected = x.float() @ reference.T
            got = blocks.to_torch().matmul(x).float()
            # bf16 scales and accumulation: within bf16's precision of the product's scale
            assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_act_order_groups_that_no_order_makes_whole_blocks_take_no_4_bit_path():
    fmt = FORMATS["gptq-act-order-g32"]
    rng = np.random.default_rng(0)
    quantized = quantize(torch.randn(16, 64), fmt, rng)
    parts = pack(quantized, fmt)
    parts["g_idx"] = torch.tensor([0] * 31 + [1] * 33, dtype=torch.int32)  # 31 and 33 columns
    int4 = unpack(scheme_of({"quantization_config": fmt.quantization_config()}), "m", parts)
    assert int4.to_q4_blocks() is None


def test_linears_that_take_their_inputs_in_different_orders_fuse_into_no_blocks():
    """q/k/v (or gate/up) read one input, so GPTQ visits their columns in one order; blocks in
    two orders would need two gathers for one fused matmul."""
    fmt = FORMATS["gptq-act-order-g32"]
    scheme = scheme_of({"quantization_config": fmt.quantization_config()})
    rng = np.random.default_rng(0)
    blocks = [unpack(scheme, "m", pack(quantize(torch.randn(16, 64), fmt, rng), fmt))
              .to_q4_blocks() for _ in range(2)]
    assert not np.array_equal(blocks[0].input_order, blocks[1].input_order)
    assert gguf_int4.concat(blocks) is None
    fused = gguf_int4.concat([blocks[0], blocks[0]])
    torch.testing.assert_close(fused.dequantized(),
                               torch.cat([blocks[0].dequantized()] * 2), atol=0, rtol=0)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, model_dir):
    """(name, folder, the float32 HF model holding the checkpoint's dequantized weights)."""
    make_config, format_name = CHECKPOINTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = write_model(make_config(), folder / "float", model_dir)
    write_int4_checkpoint(hf_model, FORMATS[format_name], folder / "int4", model_dir)
    return request.param, folder / "int4", hf_model


def test_float32_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoint):
    name, folder, hf_model = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.quantization.startswith(name.split("-")[1].upper())
    for prompt, output in zip(PROMPTS, _greedy(llm, PROMPTS)):
        assert output.token_ids == _hf_greedy(hf_model, prompt), name


def test_bf16_small_steps_run_on_the_checkpoints_4_bit_codes(checkpoint):
    name, folder, hf_model = checkpoint
    if not gguf_int4.int4_supported():
        pytest.skip("no torch int4 CPU op")
    llm = LLM(model=str(folder), dtype="bfloat16", num_kv_blocks=64, int4_max_tokens=4)
    runner = llm.engine.runner
    assert runner.uses_int4, f"{name}: the small steps multiply the checkpoint's codes"
    fmt = FORMATS[CHECKPOINTS[name][1]]
    # the native kernels' tiles hold inputs in order, with float16 scales and offsets: the
    # symmetric zero point's offset, -8 * scale, is one; 4-bit zero points times scales are not
    native = fmt.sym and not fmt.act_order and native_gemv.gemv_ops() is not None
    assert runner.int4_kernel == ("native" if native else "torch"), name
    for together in (False, True):
        _check_against_reference(hf_model, PROMPTS, _greedy(llm, PROMPTS, together),
                                 f"{name}, {'together' if together else 'alone'}")


REFUSED = {
    "8-bit GPTQ": ({"quant_method": "gptq", "bits": 8, "group_size": 128},
                   "GPTQ with bits=8 is not supported"),
    "AWQ GEMV packing": ({"quant_method": "awq", "bits": 4, "group_size": 128,
                          "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    "GPTQ marlin": ({"quant_method": "gptq", "bits": 4, "group_size": 128,
                     "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     "quantization method 'bitsandbytes' is not supported"),
    "group of 48": ({"quant_method": "gptq", "bits": 4, "group_size": 48},
                    "group_size 48 is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_quantization_kvrelay_does_not_run_is_refused_at_start(case, tmp_path, model_dir):
    config, reason = REFUSED[case]
    hf_model = write_model(LlamaConfig(**DIMS), tmp_path, model_dir)
    written = json.loads((tmp_path / "config.json").read_text())
    written["quantization_config"] = config
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=reason):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
    del hf_model


@pytest.mark.parametrize("damage, reason", [
    ("drop qzeros", "lacks qzeros"),
    ("scales of another shape", r"scales: shape \(2, 128\), expected \(4, 128\)"),
    ("g_idx out of range", "g_idx: expected 256 groups in 0..3"),
])
def test_a_damaged_gptq_module_is_refused_by_name(damage, reason, tmp_path, model_dir):
    from safetensors.torch import load_file, save_file
    hf_model = write_model(LlamaConfig(**DIMS), tmp_path / "float", model_dir)
    write_int4_checkpoint(hf_model, FORMATS["gptq-g64"], tmp_path / "int4", model_dir)
    path = tmp_path / "int4" / "model.safetensors"
    tensors = load_file(str(path))
    module = "model.layers.1.mlp.gate_proj"
    if damage == "drop qzeros":
        del tensors[f"{module}.qzeros"]
    elif damage == "scales of another shape":
        module = "model.layers.1.mlp.down_proj"  # 256 inputs: 4 groups of 64
        tensors[f"{module}.scales"] = tensors[f"{module}.scales"][:2].contiguous()
    else:
        module = "model.layers.1.mlp.down_proj"
        tensors[f"{module}.g_idx"] = torch.full((256,), 9, dtype=torch.int32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=reason) as refused:
        LLM(model=str(tmp_path / "int4"), dtype="float32", num_kv_blocks=16)
    assert module in str(refused.value)


def test_a_linear_left_unquantized_runs_on_its_weights_and_the_others_on_their_codes(
        tmp_path, model_dir):
    if not gguf_int4.int4_supported():
        pytest.skip("no torch int4 CPU op")
    hf_model = write_model(LlamaConfig(**DIMS), tmp_path / "float", model_dir)
    quantized = tuple(linear for linear in LINEARS if linear != "mlp.down_proj")
    write_int4_checkpoint(hf_model, FORMATS["awq-g64"], tmp_path / "int4", model_dir,
                          linears=quantized)
    llm = LLM(model=str(tmp_path / "int4"), dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.runner.uses_int4
    for layer in llm.engine.runner.model.layers:
        assert layer.self_attn.qkv_proj.small_steps and layer.mlp.gate_up_proj.small_steps
        assert not layer.mlp.down_proj.small_steps
    _check_against_reference(hf_model, PROMPTS, _greedy(llm, PROMPTS, False), "down unquantized")
