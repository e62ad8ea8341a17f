"""Which quantization a checkpoint was saved in, read from its `quantization_config` (config.json,
or AutoGPTQ's older quantize_config.json beside it).

kvrelay reads:
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq" or "gptq_v2") and AWQ (AutoAWQ's GEMM
  packing) at 4 bits, any group size that splits the rows into whole 32-weight blocks, with or
  without act-order (`desc_act`, GPTQ's `g_idx`), symmetric or with zero points (Int4Scheme);
- FP8 weights, e4m3 or e5m2, per tensor, per channel or per block: `quant_method` "fp8"
  (transformers' and vLLM's, `weight_block_size` optional) and compressed-tensors'
  `float-quantized` format (llm-compressor's FP8 and FP8_DYNAMIC) (Fp8Scheme).
Anything else that declares a quantization (8-bit GPTQ, AWQ's GEMV packing, bitsandbytes,
compressed-tensors' integer formats, ...) is refused here, at start, with the reason: loading it
as plain weights would fail later on names like `qweight`, or worse, run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ("GPTQ (4-bit, checkpoint_format gptq or gptq_v2), AWQ (4-bit, version gemm) and "
             "FP8 weights (quant_method fp8, or compressed-tensors float-quantized)")


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    method: str  # "gptq" or "awq"
    group_size: int  # weights of a row per scale; -1: one group spans the row
    zero_offset: int  # added to the stored zero points (GPTQ v1 stores zero - 1)
    act_order: bool  # GPTQ desc_act: groups follow g_idx, not the column order

    def describe(self) -> str:
        group = "per row" if self.group_size == -1 else f"group {self.group_size}"
        order = ", act-order" if self.act_order else ""
        return f"{self.method.upper()} int4 ({group}{order})"


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    method: str  # "fp8" or "compressed-tensors"
    block: tuple[int, int] | None  # weight_block_size [rows, cols], where scales are per block

    def describe(self) -> str:
        scales = f"blocks of {self.block[0]}x{self.block[1]}" if self.block else "tensor/channel"
        return f"FP8 ({self.method}, scales per {scales})"


def quantization_config(config: dict, model_dir: Path | None = None) -> dict | None:
    """config.json's quantization_config, else quantize_config.json's contents, else None."""
    found = config.get("quantization_config")
    if found is None and model_dir is not None:
        legacy = Path(model_dir) / "quantize_config.json"
        if legacy.is_file():
            found = json.loads(legacy.read_text())
            found.setdefault("quant_method", "gptq")  # AutoGPTQ wrote only GPTQ's
    return found


def scheme_of(config: dict, model_dir: Path | None = None) -> Int4Scheme | Fp8Scheme | None:
    """The checkpoint's scheme, None for plain weights; ValueError for a quantization kvrelay
    does not run, naming what it runs."""
    found = quantization_config(config, model_dir)
    if not found:
        return None
    method = str(found.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(found)
    if method == "awq":
        return _awq(found)
    if method == "fp8":
        return _fp8(found)
    if method == "compressed-tensors":
        return _compressed_tensors(found)
    raise ValueError(f"quantization method {method or '(none named)'!r} is not supported; "
                     f"kvrelay runs {SUPPORTED}")


def _group_size(found: dict, method: str) -> int:
    group_size = int(found.get("group_size", found.get("q_group_size", 128)))
    if group_size != -1 and (group_size <= 0 or group_size % 32):
        raise ValueError(f"{method} group_size {group_size} is not supported; kvrelay runs "
                         f"group sizes that are multiples of 32, or -1 (one group a row)")
    return group_size


def _bits(found: dict, method: str) -> None:
    bits = int(found.get("bits", found.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} with bits={bits} is not supported; kvrelay runs {SUPPORTED}")


def _gptq(found: dict) -> Int4Scheme:
    _bits(found, "GPTQ")
    checkpoint_format = str(found.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; "
                         f"kvrelay runs {SUPPORTED}")
    return Int4Scheme("gptq", _group_size(found, "GPTQ"),
                      zero_offset=1 if checkpoint_format == "gptq" else 0,
                      act_order=bool(found.get("desc_act", False)))


def _awq(found: dict) -> Int4Scheme:
    _bits(found, "AWQ")
    version = str(found.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; kvrelay runs {SUPPORTED}")
    if found.get("zero_point") is False:
        raise ValueError("AWQ without zero points is not supported; kvrelay runs "
                         f"{SUPPORTED} with zero points, as AutoAWQ writes them")
    return Int4Scheme("awq", _group_size(found, "AWQ"), zero_offset=0, act_order=False)


def _block(found, where: str) -> tuple[int, int] | None:
    if found is None:
        return None
    if (not isinstance(found, (list, tuple)) or len(found) != 2
            or not all(isinstance(size, int) and size > 0 for size in found)):
        raise ValueError(f"{where}: expected two positive block sizes, got {found!r}")
    return (found[0], found[1])


def _fp8(found: dict) -> Fp8Scheme:
    return Fp8Scheme("fp8", _block(found.get("weight_block_size"), "fp8 weight_block_size"))


def _compressed_tensors(found: dict) -> Fp8Scheme:
    """float-quantized only: every config group's weights 8-bit floats."""
    formats = {found.get("format")} | {group.get("format") for group in
                                       (found.get("config_groups") or {}).values()}
    formats.discard(None)
    if formats != {"float-quantized"}:
        raise ValueError(f"compressed-tensors format {', '.join(sorted(formats)) or '(none)'} "
                         f"is not supported; kvrelay runs {SUPPORTED}")
    block = None
    for name, group in (found.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise ValueError(f"compressed-tensors group {name}: weights of type "
                             f"{weights.get('type')!r} with {weights.get('num_bits')} bits are "
                             f"not supported; kvrelay runs {SUPPORTED}")
        block = _block(weights.get("block_structure"), f"compressed-tensors group {name}") \
            or block
    return Fp8Scheme("compressed-tensors", block)
