"""Which part of each weight a tensor-parallel rank holds (Megatron's split, as vLLM does it):
q/k/v and gate/up by output rows (whole heads, whole intermediate columns), o and down by input
columns (their partial outputs summed across the ranks), embedding and head by vocabulary rows.
K/V heads split across the ranks, or, where ranks outnumber them, each rank holds the one its
query heads read (replicated). A mixture-of-experts layer's experts are split the same way, each
expert's gate/up rows and down columns (vLLM's default under tensor parallelism): every rank
runs every routed expert on its slice, the router whole on each; or, expert parallel, each rank
holds E / N experts whole and runs only those (their share of each token's sum; vLLM's
--enable-expert-parallel). Either way the ranks' partial outputs are summed as a dense MLP's.
Norms and everything else are whole on every rank."""
from __future__ import annotations

import dataclasses
import re

import torch

from kvrelay.engine.models.arch import ArchSpec

_LAYER = re.compile(r"^layers\.\d+\.(.+)\.(weight|bias)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")  # in any checkpoint's own names


def check_shardable(spec: ArchSpec, size: int, expert_parallel: bool = False) -> None:
    """ValueError where the model cannot be split `size` ways."""
    if expert_parallel and not any(spec.moe_layers):
        raise ValueError("expert parallel: the model has no mixture-of-experts layers")
    if size == 1:
        return
    checks = {"query heads": spec.num_heads, "vocabulary": spec.vocab_size}
    if not all(spec.moe_layers):
        checks["intermediate size"] = spec.intermediate_size
    if any(spec.moe_layers):
        if expert_parallel:
            checks["experts"] = spec.moe.num_experts
        else:
            checks["experts' intermediate size"] = spec.moe.intermediate_size
    for what, count in checks.items():
        if count % size:
            raise ValueError(f"tensor parallel size {size} does not divide the model's "
                             f"{what} ({count})")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor parallel size {size} and the model's {kv} KV heads: one must "
                         "divide the other")


def rank_kv_heads(num_kv_heads: int, size: int, rank: int) -> list[int]:
    """The model's KV heads rank `rank` of `size` holds: a share each, or where ranks outnumber
    the heads, the one head its query heads read."""
    if num_kv_heads >= size:
        share = num_kv_heads // size
        return list(range(rank * share, (rank + 1) * share))
    return [rank * num_kv_heads // size]


def group_kv_heads(num_kv_heads: int, size: int) -> list[list[int]]:
    return [rank_kv_heads(num_kv_heads, size, rank) for rank in range(size)]


def local_spec(spec: ArchSpec, size: int, rank: int = 0,
               expert_parallel: bool = False) -> ArchSpec:
    """The spec of one rank's shard of the model."""
    if size == 1:
        return spec
    moe = spec.moe
    if moe is not None and expert_parallel:
        moe = dataclasses.replace(moe, local_experts=local_experts(moe.num_experts, size, rank))
    elif moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // size)
    return dataclasses.replace(spec, num_heads=spec.num_heads // size,
                               num_kv_heads=max(1, spec.num_kv_heads // size),
                               intermediate_size=spec.intermediate_size // size,
                               vocab_size=spec.vocab_size // size, moe=moe)


def local_experts(num_experts: int, size: int, rank: int) -> range:
    share = num_experts // size
    return range(rank * share, (rank + 1) * share)


class Sharder:
    """Cuts a checkpoint tensor (by its canonical name) to what `rank` of `size` holds (None:
    nothing of it, another rank's expert)."""

    def __init__(self, spec: ArchSpec, rank: int, size: int,
                 expert_parallel: bool = False) -> None:
        self.spec, self.rank, self.size = spec, rank, size
        self.experts = None if spec.moe is None or not expert_parallel else \
            local_experts(spec.moe.num_experts, size, rank)
        head_dim = spec.head_dim
        q_heads = spec.num_heads // size
        self.q_rows = _span(rank * q_heads * head_dim, q_heads * head_dim)
        kv_heads = rank_kv_heads(spec.num_kv_heads, size, rank)
        self.kv_rows = _span(kv_heads[0] * head_dim, len(kv_heads) * head_dim)
        inter = spec.intermediate_size // size
        self.inter_rows = _span(rank * inter, inter)
        expert_inter = 0 if spec.moe is None else spec.moe.intermediate_size // size
        self.expert_rows = _span(rank * expert_inter, expert_inter) if self.experts is None \
            else slice(None)  # expert parallel: whole experts
        vocab = spec.vocab_size // size
        self.vocab_rows = _span(rank * vocab, vocab)

    def local_name(self, name: str) -> str:
        """A checkpoint name with its expert's global index made this rank's (expert
        parallel: expert e is this rank's e - first)."""
        if self.experts is None:
            return name
        return _EXPERT_INDEX.sub(
            lambda match: f".experts.{int(match.group(1)) - self.experts.start}.", name)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if self.size == 1:
            return tensor
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return tensor[self.vocab_rows]
        match = _LAYER.match(name)
        if match is None:
            return tensor
        return self._layer_piece(match.group(1), match.group(2), tensor)

    def _layer_piece(self, piece: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        if piece == "self_attn.q_proj":
            return tensor[self.q_rows]
        if piece in ("self_attn.k_proj", "self_attn.v_proj"):
            return tensor[self.kv_rows]
        if piece == "self_attn.qkv_proj":  # Phi-3's fused one
            q, k, v = tensor.split([q_size, kv_size, kv_size])
            return torch.cat([q[self.q_rows], k[self.kv_rows], v[self.kv_rows]])
        if piece == "self_attn.o_proj":
            if kind == "bias":  # added once: the ranks' partial outputs are summed
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return tensor[:, self.q_rows]
        if piece in ("mlp.gate_proj", "mlp.up_proj"):
            return tensor[self.inter_rows]
        if piece == "mlp.gate_up_proj":
            gate, up = tensor.chunk(2)
            return torch.cat([gate[self.inter_rows], up[self.inter_rows]])
        if piece == "mlp.down_proj":
            return tensor[:, self.inter_rows]
        return self._expert_piece(piece, tensor)

    def _expert_piece(self, piece: str, tensor: torch.Tensor) -> torch.Tensor:
        """An expert's gate/up rows and down columns; transformers 5's 3-D tensors of every
        expert ([E, 2I, H] gate first, [E, H, I]) likewise; the router whole."""
        expert = _EXPERT.match(piece)
        if expert is not None:  # one expert's [rows, columns]
            if self.experts is not None:  # expert parallel: whole, if this rank's
                return tensor if int(expert.group(1)) in self.experts else None
            down = expert.group(2) == "down_proj"
            return tensor[:, self.expert_rows] if down else tensor[self.expert_rows]
        if self.experts is not None and piece in ("mlp.experts.down_proj",
                                                  "mlp.experts.gate_up_proj"):
            return tensor[self.experts.start:self.experts.stop]
        if piece == "mlp.experts.down_proj":
            return tensor[:, :, self.expert_rows]
        if piece == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            return torch.cat([gate[:, self.expert_rows], up[:, self.expert_rows]], dim=1)
        return tensor


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)
