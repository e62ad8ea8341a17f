"""A LoRA adapter in the PEFT format, read and checked against the base model it is for.

A PEFT directory holds adapter_config.json (rank `r`, `lora_alpha`, `use_rslora`, per-module
`rank_pattern`/`alpha_pattern`, ...) and adapter_model.safetensors with one A [r, in] and one
B [out, r] per adapted linear, named after the module (model.layers.3.self_attn.q_proj...).
Everything is checked before anything is returned, so a file that fails leaves whatever
adapters are running untouched; the reason names the file, key or field. The scaling
(alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B here, once.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvrelay.engine.models.arch import ArchSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight, with PEFT's prefix or without
KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                 r"(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass(frozen=True, slots=True)
class LoRAPair:
    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32, the scaling folded in


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    rank: int  # the largest of its modules' ranks
    modules: dict[tuple[int, str], LoRAPair]  # (layer, module name as PEFT names it) -> pair

    @property
    def target_names(self) -> frozenset[str]:
        return frozenset(target for _, target in self.modules)


def module_shapes(spec: ArchSpec) -> dict[str, tuple[str, int, int]]:
    """Every module an adapter may target: name -> (block, in features, out features). The
    fused names are Phi-3's (its checkpoint, and so its adapters, fuse q/k/v and gate/up)."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {"q_proj": ("self_attn", hidden, q_size), "k_proj": ("self_attn", hidden, kv_size),
            "v_proj": ("self_attn", hidden, kv_size),
            "qkv_proj": ("self_attn", hidden, q_size + 2 * kv_size),
            "o_proj": ("self_attn", q_size, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
            "gate_up_proj": ("mlp", hidden, 2 * inter), "down_proj": ("mlp", inter, hidden)}


def read_adapter(path: str | Path, spec: ArchSpec, max_rank: int) -> LoRAAdapter:
    """The adapter in directory `path`, checked against the model `spec` describes."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter path {str(directory)!r} is not a directory")
    config = _read_config(directory)
    weights = _read_weights(directory)
    pairs = _pair_up(weights, spec)
    modules = {}
    for (layer, target), (a, b) in pairs.items():
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"module model.layers.{layer}.{target} has rank {rank}, above "
                               f"--max-lora-rank {max_rank}")
        modules[(layer, target)] = LoRAPair(a, b * _scaling(config, layer, target, rank))
    return LoRAAdapter(max(pair.a.shape[0] for pair in modules.values()), modules)


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{CONFIG_FILE} not found in {str(directory)!r}")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    _check_config(config)
    return config


def _check_config(config: dict) -> None:
    """Refuse the PEFT options whose effect kvrelay does not compute (never ignore them)."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not served; only LORA is")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias {config.get('bias')!r} is not served; only 'none' is")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{flag} is not served")
    if config.get("modules_to_save"):
        raise AdapterError("modules_to_save is not served (the adapter would replace whole "
                           f"modules: {config['modules_to_save']})")
    if config.get("lora_bias"):
        raise AdapterError("lora_bias is not served")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise AdapterError(f"{name} must be an object")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        pickle = (directory / "adapter_model.bin").is_file()
        raise AdapterError(f"{WEIGHTS_FILE} not found in {str(directory)!r}" + (
            " (adapter_model.bin is a pickle and is not read: save the adapter with "
            "safe_serialization=True)" if pickle else ""))
    try:
        with safe_open(str(file), framework="pt") as tensors:
            return {key: tensors.get_tensor(key) for key in tensors.keys()}
    except Exception as error:  # safetensors raises its own and OS errors on a bad file
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {error}") from None


def _pair_up(weights: dict[str, torch.Tensor],
             spec: ArchSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) in float32, every key and shape checked."""
    if not weights:
        raise AdapterError(f"{WEIGHTS_FILE} holds no tensors")
    shapes, halves = module_shapes(spec), {}
    for key, tensor in weights.items():
        match = KEY.match(key)
        if match is None:
            raise AdapterError(f"unexpected tensor {key!r}: kvrelay serves LoRA on the "
                               f"decoder layers' {', '.join(shapes)}")
        layer, block, target, half = int(match[1]), match[2], match[3], match[4]
        _check_target(key, layer, block, target, spec, shapes)
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise AdapterError(f"{key}: expected a 2-D floating-point tensor, got "
                               f"{tensor.dtype} {tuple(tensor.shape)}")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{key} holds non-finite values")
        halves.setdefault((layer, target), {})[half] = tensor.float()
    pairs = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(f"model.layers.{layer}.{target} has no lora_{missing} weight")
        pairs[(layer, target)] = _check_shapes(layer, target, pair["A"], pair["B"], shapes)
    _check_no_overlap(pairs)
    return pairs


def _check_target(key: str, layer: int, block: str, target: str, spec: ArchSpec,
                  shapes: dict) -> None:
    if target not in shapes or shapes[target][0] != block:
        raise AdapterError(f"{key}: module {block}.{target} is not one kvrelay serves LoRA on "
                           f"(it serves {', '.join(shapes)})")
    if layer >= spec.num_layers:
        raise AdapterError(f"{key}: layer {layer} does not exist (the model has "
                           f"{spec.num_layers})")
    if block == "mlp" and spec.moe_layers[layer]:
        raise AdapterError(f"{key}: layer {layer} is a mixture of experts; LoRA on experts is "
                           "not served")


def _check_shapes(layer: int, target: str, a: torch.Tensor, b: torch.Tensor,
                  shapes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    _, in_features, out_features = shapes[target]
    name = f"model.layers.{layer}.{target}"
    if a.shape[1] != in_features or b.shape[0] != out_features or a.shape[0] != b.shape[1]:
        raise AdapterError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                           f"not fit this model's [{out_features}, {in_features}] weight (an "
                           "adapter for another base model?)")
    if a.shape[0] < 1:
        raise AdapterError(f"{name}: rank 0")
    return a, b


def _check_no_overlap(pairs: dict) -> None:
    """A fused name and its parts on one layer would add two updates to the same outputs."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for (layer, target) in pairs:
        for part in fused.get(target, ()):
            if (layer, part) in pairs:
                raise AdapterError(f"model.layers.{layer} has both {target} and {part}")


def _scaling(config: dict, layer: int, target: str, rank: int) -> float:
    """PEFT's scaling for one module: its alpha (alpha_pattern, else lora_alpha) over its rank,
    or over the rank's square root with rsLoRA."""
    module = f"model.layers.{layer}.{'self_attn' if target in _ATTENTION else 'mlp'}.{target}"
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"})


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: the first pattern key that matches the module name's end (as a regex)."""
    for key, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as error:
            raise AdapterError(f"alpha_pattern key {key!r} is not a regular expression: "
                               f"{error}") from None
        if matched:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise AdapterError(f"alpha_pattern[{key!r}] must be a positive number")
            return value
    return default
