"""Load a model directory's safetensors into LlamaForCausalLM, fusing q/k/v and gate/up."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from kvrelay.engine.models.llama import LlamaForCausalLM

# HF name piece -> (our fused parameter, index of the shard inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)"
                         r"\.(weight|bias)$")


def iter_checkpoint(model_dir: Path):
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(model_dir):
        if "rotary_emb" in name:
            continue
        target, shard = _target_name(name)
        if shard is None:
            _copy(params, target, tensor)
            loaded.add(target)
            continue
        pending.setdefault(target, {})[shard] = tensor
        expected = 3 if "qkv" in target else 2
        if len(pending[target]) == expected:
            shards = pending.pop(target)
            _copy(params, target, torch.cat([shards[i] for i in range(expected)], dim=0))
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}")


def _target_name(name: str) -> tuple[str, int | None]:
    match = _LAYER_NAME.match(name)
    if match:
        layer, piece, kind = match.groups()
        fused, shard = _FUSED[piece]
        return f"layers.{layer}.{fused}.{kind}", shard
    return name.removeprefix("model."), None


def _copy(params: dict, target: str, tensor: torch.Tensor) -> None:
    if target not in params:
        if target == "lm_head.weight":
            return  # tied embeddings: the checkpoint may still carry a copy
        raise ValueError(f"unexpected weight {target} in checkpoint")
    param = params[target]
    if param.shape != tensor.shape:
        raise ValueError(f"weight {target}: checkpoint shape {tuple(tensor.shape)} "
                         f"!= model shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
