"""Reference 4-bit quantizers and packers for GPTQ and AWQ checkpoints, written from the formats'
layouts (AutoGPTQ / GPTQModel and AutoAWQ's GEMM packing), independent of kvrelay's unpacking:
round-to-nearest per group (the packing is what the loaders read; how the codes were chosen,
GPTQ's Hessian updates or AWQ's activation scales, does not change it).

- GPTQ: qweight int32 [K/8, N] (input rows 8 a word, row k at bits 4*(k%8)); qzeros int32
  [G, N/8] (column n at bits 4*(n%8)), storing zero - 1 in checkpoint_format "gptq";
  scales float16 [G, N]; g_idx int32 [K]. With act-order the columns' groups follow a
  permutation (GPTQ quantizes columns in descending Hessian order and records their groups).
- AWQ GEMM: qweight int32 [K, N/8], qzeros int32 [G, N/8], each word eight output columns with
  column 8c + ORDER[i] in nibble i; scales float16 [G, N].
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

SAME_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
              "mlp.up_proj": "mlp.gate_proj"}


@dataclass(frozen=True)
class Format:
    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group a row
    sym: bool = False
    act_order: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (zero - 1 stored) or "gptq_v2"

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size,
                "desc_act": self.act_order, "sym": self.sym,
                "checkpoint_format": self.checkpoint_format}


@dataclass(frozen=True)
class Quantized:
    q: np.ndarray  # [N, K] int64 in 0..15
    scales: np.ndarray  # [G, N] float16
    zeros: np.ndarray  # [G, N] int64
    g_idx: np.ndarray  # [K] int64

    def dequantized(self) -> torch.Tensor:
        """w[n, k] = scale[g, n] * (q[n, k] - zero[g, n]) with g = g_idx[k], in float32."""
        scales = self.scales.astype(np.float32)[self.g_idx].T
        zeros = self.zeros[self.g_idx].T.astype(np.float32)
        return torch.from_numpy(scales * (self.q.astype(np.float32) - zeros))


def quantize(weight: torch.Tensor, fmt: Format, rng: np.random.Generator,
             act_order: np.ndarray | None = None) -> Quantized:
    """Round to nearest per group of fmt.group_size inputs of a row. act_order: the order GPTQ
    visits the inputs in (its Hessian's; random where not given), for fmt.act_order."""
    w = weight.detach().float().numpy()
    num_outputs, num_inputs = w.shape
    size = num_inputs if fmt.group_size == -1 else fmt.group_size
    num_groups = num_inputs // size
    g_idx = np.arange(num_inputs) // size
    if fmt.act_order:
        g_idx = np.empty(num_inputs, dtype=np.int64)
        visited = rng.permutation(num_inputs) if act_order is None else act_order
        g_idx[visited] = np.arange(num_inputs) // size
    q = np.zeros(w.shape, dtype=np.int64)
    scales = np.zeros((num_groups, num_outputs), dtype=np.float16)
    zeros = np.zeros((num_groups, num_outputs), dtype=np.int64)
    # "gptq" stores zero - 1 in four bits, so its zero points start at 1
    lowest_zero = 1 if fmt.method == "gptq" and fmt.checkpoint_format == "gptq" else 0
    for group in range(num_groups):
        columns = np.flatnonzero(g_idx == group)
        block = w[:, columns]
        low, high = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        span = np.maximum(np.abs(low), high) / 7.5 if fmt.sym else (high - low) / 15
        scale = np.maximum(span, 1e-3).astype(np.float16)
        zero = np.full(num_outputs, 8) if fmt.sym else \
            np.clip(np.round(-low / scale.astype(np.float32)), lowest_zero, 15)
        codes = np.round(block / scale.astype(np.float32)[:, None]) + zero[:, None]
        q[:, columns] = np.clip(codes, 0, 15)
        scales[group], zeros[group] = scale, zero
    return Quantized(q, scales, zeros, g_idx)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values in 0..15 -> [...] int32, nibble i at bits 4i."""
    shifts = np.arange(0, 32, 4, dtype=np.uint64)
    packed = (nibbles.astype(np.uint64) << shifts).sum(-1).astype(np.uint32)
    return packed.view(np.int32)


def pack(quantized: Quantized, fmt: Format) -> dict[str, torch.Tensor]:
    num_outputs, num_inputs = quantized.q.shape
    scales = torch.from_numpy(quantized.scales.copy())
    if fmt.method == "awq":
        order = list(AWQ_PACK_ORDER)
        columns = quantized.q.T.reshape(num_inputs, num_outputs // 8, 8)[..., order]
        zeros = quantized.zeros.reshape(len(quantized.zeros), num_outputs // 8, 8)[..., order]
        return {"qweight": torch.from_numpy(_words(columns)),
                "qzeros": torch.from_numpy(_words(zeros)), "scales": scales}
    rows = quantized.q.T.reshape(num_inputs // 8, 8, num_outputs).transpose(0, 2, 1)
    stored = quantized.zeros - (1 if fmt.checkpoint_format == "gptq" else 0)
    zeros = stored.reshape(len(stored), num_outputs // 8, 8)
    return {"qweight": torch.from_numpy(_words(rows)), "qzeros": torch.from_numpy(_words(zeros)),
            "scales": scales, "g_idx": torch.from_numpy(quantized.g_idx.astype(np.int32))}


def write_int4_checkpoint(hf_model, fmt: Format, folder: Path, tokenizer_dir: Path,
                          seed: int = 0, linears: tuple[str, ...] = LINEARS) -> None:
    """Quantize hf_model's layer linears (those named in `linears`; the others stay float, as
    a quantizer's modules_to_not_convert leaves them) into `folder` as `fmt` writes them
    (config.json with its quantization_config, tokenizer files beside), and put the
    dequantized weights back into hf_model: it becomes the float32 reference of the
    checkpoint."""
    rng = np.random.default_rng(seed)
    tensors = {}
    orders = {}  # linears that read one input (q/k/v, gate/up) share GPTQ's Hessian order
    state = hf_model.state_dict()
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        layer, _, linear = module.split(".layers.")[-1].partition(".")
        if name.endswith(".weight") and linear in linears:
            key = (layer, SAME_INPUT.get(linear, linear))
            order = orders.setdefault(key, rng.permutation(tensor.shape[1]))
            quantized = quantize(tensor, fmt, rng, order)
            tensors.update({f"{module}.{part}": value.contiguous()
                            for part, value in pack(quantized, fmt).items()})
            with torch.no_grad():
                hf_model.get_parameter(name).copy_(quantized.dequantized())
        elif not (name == "lm_head.weight" and hf_model.config.tie_word_embeddings):
            tensors[name] = tensor.contiguous()
    save_quantized(folder, tensors, hf_model.config, fmt.quantization_config(), tokenizer_dir)


def save_quantized(folder: Path, tensors: dict, hf_config, quantization_config: dict,
                   tokenizer_dir: Path) -> None:
    """A quantized checkpoint directory: the tensors, config.json with its
    quantization_config, and the tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config.to_dict()
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file_name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file_name, folder / file_name)
