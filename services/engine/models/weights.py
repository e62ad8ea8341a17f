"""Load a model directory's safetensors into a DecoderLM: q/k/v, gate/up and each expert's
gate/up fused into the model's one matmul each, every other tensor copied by name.

Names are first put in the canonical Hugging Face form by the family (`rename`: Mixtral's
block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj, ...); a checkpoint that already holds a
fused tensor (Phi-3's qkv_proj, transformers 5's 3-D experts) is copied whole. Every parameter
must be covered exactly; anything unknown or mis-shaped is refused with its name.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

# canonical piece -> (the model's fused parameter, which shard of it)
_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
_FUSED_EXPERTS = {"mlp.experts.gate_up_proj": "mlp.experts.w13",
                  "mlp.experts.down_proj": "mlp.experts.w2"}


def iter_checkpoint(model_dir: Path):
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class _Loader:
    """Copies tensors into the model's parameters and marks the rows each one received."""

    def __init__(self, model) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        # parameter -> which of its rows ([rows], or [experts, rows]) a tensor has filled
        self.filled = {name: torch.zeros(param.shape[:2] if param.dim() == 3 else param.shape[:1],
                                         dtype=torch.bool)
                       for name, param in self.params.items()}

    def copy(self, target: str, tensor: torch.Tensor, piece: tuple = ()) -> None:
        """piece: where in the parameter the tensor goes (an expert index, a row slice)."""
        if target not in self.params:
            if target == "lm_head.weight" and self.model.tie_word_embeddings:
                return  # tied embeddings: the checkpoint may still carry a copy
            raise ValueError(f"unexpected weight {target} in checkpoint")
        destination = self.params[target].data[piece] if piece else self.params[target].data
        if destination.shape != tensor.shape:
            raise ValueError(f"weight {target}{_describe(piece)}: checkpoint shape "
                             f"{tuple(tensor.shape)} != model shape {tuple(destination.shape)}")
        with torch.no_grad():
            destination.copy_(tensor)
        self.filled[target][piece] = True

    def missing(self) -> list[str]:
        return [name for name, filled in self.filled.items() if not bool(filled.all())]


def _describe(piece: tuple) -> str:
    return "".join(f"[{item.start}:{item.stop}]" if isinstance(item, slice) else f"[{item}]"
                   for item in piece)


def load_weights(model, model_dir: Path, rename: Callable[[str], str] = lambda name: name,
                 tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """rename: the family's checkpoint name -> canonical name (prefix `model.` already off);
    tensors: (name, tensor) pairs in place of the directory's own (int4_checkpoint.py)."""
    loader = _Loader(model)
    for name, tensor in iter_checkpoint(model_dir) if tensors is None else tensors:
        if "rotary_emb" in name:
            continue
        canonical = rename(name.removeprefix("model."))
        _route(loader, model, canonical, tensor)
    missing = loader.missing()
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}")


def _route(loader: _Loader, model, name: str, tensor: torch.Tensor) -> None:
    match = _LAYER.match(name)
    if match is None:
        loader.copy(name, tensor)
        return
    layer, piece, kind = int(match.group(1)), match.group(2), match.group(3)
    prefix = f"layers.{layer}."
    if piece in _SHARDS:
        fused, shard = _SHARDS[piece]
        rows = _shard_rows(model.layers[layer], fused, shard)
        loader.copy(f"{prefix}{fused}.{kind}", tensor, (rows,))
    elif (expert := _EXPERT.match(piece)) is not None:
        index, which = int(expert.group(1)), expert.group(2)
        if which == "down":
            loader.copy(f"{prefix}mlp.experts.w2", tensor, (index,))
        else:
            size = model.layers[layer].mlp.spec.intermediate_size
            rows = slice(0, size) if which == "gate" else slice(size, 2 * size)
            loader.copy(f"{prefix}mlp.experts.w13", tensor, (index, rows))
    elif piece in _FUSED_EXPERTS:
        loader.copy(f"{prefix}{_FUSED_EXPERTS[piece]}", tensor)
    else:
        loader.copy(name, tensor)


def _shard_rows(layer, fused: str, shard: int) -> slice:
    if fused == "self_attn.qkv_proj":
        attention = layer.self_attn
        bounds = (0, attention.q_size, attention.q_size + attention.kv_size,
                  attention.q_size + 2 * attention.kv_size)
    else:
        size = layer.mlp.intermediate_size
        bounds = (0, size, 2 * size)
    return slice(bounds[shard], bounds[shard + 1])
