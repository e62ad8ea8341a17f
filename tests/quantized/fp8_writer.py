"""A reference FP8 quantizer and the two configs FP8 checkpoints are published with, written from
the formats' descriptions: `quant_method` "fp8" (transformers' FineGrainedFP8 / vLLM's, scales per
128x128 block in `weight_scale_inv`) and compressed-tensors' `float-quantized` (llm-compressor's
FP8: `weight_scale` per tensor or per output channel, static `input_scale` for W8A8)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.quantized.int4_writer import LINEARS, save_quantized

E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "fp8" or "compressed-tensors"
    strategy: str  # "tensor", "channel" or "block"
    block: tuple[int, int] = (128, 128)
    static_inputs: bool = False  # an input_scale per linear (W8A8 calibration)

    def quantization_config(self) -> dict:
        if self.method == "fp8":
            config = {"quant_method": "fp8", "activation_scheme":
                      "static" if self.static_inputs else "dynamic"}
            if self.strategy == "block":
                config["weight_block_size"] = list(self.block)
            return config
        weights = {"num_bits": 8, "type": "float", "strategy": self.strategy,
                   "symmetric": True, "dynamic": False}
        if self.strategy == "block":
            weights["block_structure"] = list(self.block)
        inputs = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                  "dynamic": not self.static_inputs}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": inputs}},
                "ignore": ["lm_head"]}

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"


def quantize(weight: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scale: [1], [N, 1] or the block grid),
    each scale the largest magnitude it covers over e4m3's largest value."""
    w = weight.detach().float()
    if fmt.strategy == "tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(1)
    elif fmt.strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / E4M3_MAX
    else:
        block_rows, block_cols = fmt.block
        rows, cols = w.shape
        scale = torch.zeros(-(-rows // block_rows), -(-cols // block_cols))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols]
                scale[i, j] = tile.abs().max() / E4M3_MAX
    return (w / _expanded(scale, fmt, *w.shape)).to(torch.float8_e4m3fn), scale


def dequantized(fp8: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    return fp8.float() * _expanded(scale, fmt, *fp8.shape)


def _expanded(scale: torch.Tensor, fmt: Fp8Format, rows: int, cols: int) -> torch.Tensor:
    """The scale of each weight, [N, K] (broadcast)."""
    if fmt.strategy != "block":
        return scale.reshape(-1, 1)
    scale = scale.repeat_interleave(fmt.block[0], 0)[:rows]
    return scale.repeat_interleave(fmt.block[1], 1)[:, :cols]


def write_fp8_checkpoint(hf_model, fmt: Fp8Format, folder: Path, tokenizer_dir: Path) -> None:
    """hf_model's layer linears in FP8 into `folder` (config.json with the quantization_config,
    the tokenizer beside); hf_model gets the dequantized weights: the float32 reference."""
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        module = name.removesuffix(".weight")
        linear = module.split(".layers.")[-1].partition(".")[2]
        if name.endswith(".weight") and linear in LINEARS:
            fp8, scale = quantize(tensor, fmt)
            tensors[name] = fp8.contiguous()
            tensors[f"{module}.{fmt.scale_name}"] = scale.contiguous()
            if fmt.static_inputs:
                tensors[f"{module}.input_scale"] = torch.tensor([0.05])
            with torch.no_grad():
                hf_model.get_parameter(name).copy_(dequantized(fp8, scale, fmt))
        elif not (name == "lm_head.weight" and hf_model.config.tie_word_embeddings):
            tensors[name] = tensor.contiguous()
    save_quantized(folder, tensors, hf_model.config, fmt.quantization_config(), tokenizer_dir)
