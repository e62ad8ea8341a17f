"""FP8 checkpoints (quant_schemes.py, fp8_checkpoint.py), written by fp8_writer.py's reference
quantizer with each config FP8 models are published with: the weights kvrelay loads equal the
reference's dequantization bit for bit, its greedy tokens in float32 equal transformers' on the
dequantized weights, and a float8 weight without its scale, a scale of no scheme's shape, or an
integer compressed-tensors format is refused at start with the reason."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config

from kvrelay.engine import LLM
from tests.families.checkpoints import write_model
from tests.families.test_family_gguf import PROMPTS, _greedy, _hf_greedy
from tests.quantized.fp8_writer import Fp8Format, write_fp8_checkpoint
from tests.quantized.test_int4_checkpoints import DIMS

CHECKPOINTS = {
    "llama-fp8-block": (lambda: LlamaConfig(**DIMS), Fp8Format("fp8", "block", (64, 64))),
    "qwen3-compressed-channel": (lambda: Qwen3Config(**DIMS, tie_word_embeddings=False),
                                 Fp8Format("compressed-tensors", "channel", static_inputs=True)),
    "llama-compressed-tensor": (lambda: LlamaConfig(**DIMS),
                                Fp8Format("compressed-tensors", "tensor")),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, model_dir):
    make_config, fmt = CHECKPOINTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = write_model(make_config(), folder / "float", model_dir)
    write_fp8_checkpoint(hf_model, fmt, folder / "fp8", model_dir)
    return request.param, folder / "fp8", hf_model


def test_loaded_weights_equal_the_reference_dequantization(checkpoint):
    name, folder, hf_model = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.quantization.startswith("FP8")
    params = dict(llm.engine.runner.model.named_parameters())
    reference = hf_model.state_dict()
    attention = params["layers.1.self_attn.qkv_proj.weight"]
    expected = torch.cat([reference[f"model.layers.1.self_attn.{piece}_proj.weight"]
                          for piece in "qkv"])
    torch.testing.assert_close(attention, expected, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(params["layers.0.mlp.down_proj.weight"],
                               reference["model.layers.0.mlp.down_proj.weight"], atol=0, rtol=0)


def test_float32_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoint):
    name, folder, hf_model = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    for prompt, output in zip(PROMPTS, _greedy(llm, PROMPTS)):
        assert output.token_ids == _hf_greedy(hf_model, prompt), name


def _damaged(tmp_path, model_dir, damage) -> str:
    hf_model = write_model(LlamaConfig(**DIMS), tmp_path / "float", model_dir)
    write_fp8_checkpoint(hf_model, Fp8Format("fp8", "block", (64, 64)), tmp_path / "fp8",
                         model_dir)
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    damage(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(tmp_path / "fp8")


MODULE = "model.layers.1.mlp.up_proj"


@pytest.mark.parametrize("damage, reason", [
    (lambda tensors: tensors.pop(f"{MODULE}.weight_scale_inv"),
     f"{MODULE}.weight is float8 without a weight_scale"),
    (lambda tensors: tensors.update({f"{MODULE}.weight_scale_inv": torch.ones(3, 5)}),
     rf"{MODULE}: scale shape \(3, 5\) fits no FP8 scheme for a \[256, 128\] weight"),
    (lambda tensors: tensors.update({f"{MODULE}.weight_scale_inv": torch.full((4, 2), float("inf"))}),
     f"{MODULE}: not every weight scale is finite"),
], ids=["no scale", "scale of another shape", "infinite scale"])
def test_a_damaged_fp8_module_is_refused_by_name(damage, reason, tmp_path, model_dir):
    with pytest.raises(ValueError, match=reason):
        LLM(model=_damaged(tmp_path, model_dir, damage), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("config, reason", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "compressed-tensors format pack-quantized is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"weights": {"type": "int", "num_bits": 8}}}},
     "compressed-tensors group group_0: weights of type 'int' with 8 bits are not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     "fp8 weight_block_size: expected two positive block sizes"),
], ids=["pack-quantized", "int8 weights", "one block size"])
def test_an_fp8_config_kvrelay_does_not_run_is_refused_at_start(config, reason, tmp_path,
                                                                model_dir):
    write_model(LlamaConfig(**DIMS), tmp_path, model_dir)
    written = json.loads((tmp_path / "config.json").read_text())
    written["quantization_config"] = config
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=reason):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
