"""What sets one decoder family apart from another, as data: the options the shared layers
(models/layers/) take. A family module (models/<family>.py) turns a Hugging Face config into an
ArchSpec; models/decoder.py builds any of them from it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # divide the top-k weights by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    # expert parallel: the experts this rank holds whole (the router still scores all of them);
    # None: every expert (one rank, or each expert split by columns under tensor parallel)
    local_experts: range | None = None


@dataclass(frozen=True, slots=True)
class ArchSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    layer_windows: tuple[int, ...]  # per layer: 0 = full attention, W = the last W keys only
    layer_ropes: tuple[str, ...]  # per layer: the key of its rope parameters (rope.py)
    moe_layers: tuple[bool, ...]  # per layer: a mixture-of-experts block instead of the MLP
    moe: MoESpec | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    norm_offset: bool = False  # norms scale by (1 + w) (Gemma), not w
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    activation: str = "silu"  # of the gate: "silu" or "gelu_tanh"
    query_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float = 0.0  # attention logits soft-capped at this (0: not)
    final_soft_cap: float = 0.0  # output logits soft-capped at this (0: not)
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden))
    rotary_dim: int | None = None  # rope on the first rotary_dim of each head (None: all)
    tie_word_embeddings: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_windows(config) -> tuple[int, ...]:
    """Per-layer windows from `layer_types` ("sliding_attention" layers see `sliding_window`
    keys), as transformers 5 configs list them for Qwen2/3 and Gemma 2/3."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def uniform_windows(config) -> tuple[int, ...]:
    """Every layer windowed by `sliding_window` where set (Mistral, Mixtral, Phi-3, Qwen3-MoE)."""
    return (getattr(config, "sliding_window", None) or 0,) * config.num_hidden_layers


def dense_spec(config, **options) -> ArchSpec:
    """The fields every family reads the same way; `options` are the family's own."""
    num_layers = config.num_hidden_layers
    fields = dict(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config),
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps, layer_windows=uniform_windows(config),
        layer_ropes=("default",) * num_layers, moe_layers=(False,) * num_layers,
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    fields.update(options)
    return ArchSpec(**fields)
