"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat varlen batch.

Tokens of all sequences in a step are concatenated ([num_tokens, hidden]); attention reads and
writes the paged KV cache through kernels/. No padding, and logits only for sampled rows.
q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs run faster.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.dispatch import paged_attention, store_kv
from kvrelay.kernels import native_elementwise as fused
from kvrelay.engine.models.decode_stack import DecodeStack
from kvrelay.engine.models.packed_linear import PackedLinear, pack_linears_
from kvrelay.engine.models.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.native = None  # fused CPU ops (bf16), see LlamaForCausalLM.use_native_cpu_ops_

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, hidden]
        if self.native is not None:
            return fused.rms_norm(self.native, x.contiguous(), self.weight, self.eps)
        # Same order of operations as transformers (in float32 whatever the dtype), so float32
        # outputs match bit for bit; F.rms_norm on bf16 measured no faster and less accurate.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Native ops only: residual += x in place; returns RMSNorm(residual)."""
        return fused.add_rms_norm(self.native, x.contiguous(), residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        self.native = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        # rope: cos, sin [T, 1, D]; hidden [T, hidden]; K,V [num_blocks, block_size, kv_heads, D]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)  # q and k heads, one pass
        qk = fused.rope(self.native, qk, *rope) if self.native is not None else apply_rope(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        out = paged_attention(q, k_cache, v_cache, attn_meta, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.native is not None:  # one pass instead of silu's and the product's
            return self.down_proj(fused.silu_and_mul(self.native, gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, kv_cache, slot_mapping, attn_meta) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache,
                                         slot_mapping, attn_meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, rope, delta: torch.Tensor | None, residual: torch.Tensor, kv_cache,
                      slot_mapping, attn_meta) -> torch.Tensor:
        """The same layer with each skip connection's add fused into the norm after it (native
        ops): the residual stream is `residual + delta` (delta None on the first layer), updated
        in place; returns this layer's MLP output, the next delta."""
        if delta is None:
            normed = self.input_layernorm(residual)
        else:
            normed = self.input_layernorm.add_and_norm(delta, residual)
        attn_out = self.self_attn(rope, normed, kv_cache, slot_mapping, attn_meta)
        return self.mlp(self.post_attention_layernorm.add_and_norm(attn_out, residual))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: PackedLinear | None = None
        # every layer of a small decode step in one native call (decode_stack.py), if attached
        self.decode_stack: DecodeStack | None = None

    def use_native_cpu_ops_(self, ops) -> None:
        """Route norms, rope and the MLP's activation to the fused CPU kernels (one pass each)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.native = ops

    @property
    def layer_windows(self) -> list[int]:
        """Per layer, the keys its attention sees (the last W; 0: all of them)."""
        return layer_windows(self.config)

    @property
    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def pack_for_cpu_(self) -> None:
        """After loading bf16 weights on CPU: pre-pack every matmul's weight for oneDNN."""
        self.packed_head = PackedLinear(self.head_weight, None)
        pack_linears_(self.layers)

    def add_small_step_kernels_(self, max_rows: int, layer_matmuls: dict,
                                head_matmul: Callable | None) -> None:
        """Steps of at most max_rows tokens run on other kernels (small_steps.py):
        layer_matmuls maps parameter name ("layers.3.mlp.down_proj") -> its matmul."""
        for name, module in self.named_modules():
            if name in layer_matmuls:
                module.add_small_step_kernel_(max_rows, layer_matmuls[name])
        if head_matmul is not None and self.packed_head is not None:
            self.packed_head.add_small_step_kernel_(max_rows, head_matmul)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                slot_mappings: list[torch.Tensor], attn_metas: list[AttentionMetadata],
                logits_indices: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        # input_ids, positions [T]; per layer: its K/V pages, slot mapping [T] and metadata
        # (its KV group's: model_runner.py); logits_indices [S] rows to sample -> [S, vocab]
        # on_layer_done(i) runs once layer i's KV for this step is stored (the KV connector
        # starts pushing that layer while later layers compute).
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.tables_for(positions, hidden.dtype)
        if self.norm.native is not None:
            hidden = self._layers_fused(rope, hidden, kv_caches, slot_mappings, attn_metas,
                                        logits_indices, on_layer_done)
        else:
            for index, layer in enumerate(self.layers):
                hidden = layer(rope, hidden, kv_caches[index], slot_mappings[index],
                               attn_metas[index])
                if on_layer_done is not None:
                    on_layer_done(index)
            hidden = self.norm(hidden[logits_indices])
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        return F.linear(hidden, self.head_weight).float()

    def _layers_fused(self, rope, hidden, kv_caches, slot_mappings, attn_metas, logits_indices,
                      on_layer_done) -> torch.Tensor:
        """The layers with fused add + norm; returns the final norm of the sampled rows only
        (their last add is the only one still needed). hidden [T, hidden] -> [S, hidden]."""
        residual, delta = hidden, None  # the embedding is a fresh tensor: updated in place
        stack = self.decode_stack
        # (the stack is attached only where every layer shares one block table: model_runner)
        if stack is not None and stack.takes(hidden.shape[0], attn_metas[0], kv_caches):
            delta = stack.run(residual, rope, kv_caches, slot_mappings[0], attn_metas[0])
            # every layer's K/V is stored by now: a push that waits on them starts at once
            # (the stack's steps are a few tokens, so little overlap is lost)
            for index in range(len(self.layers) if on_layer_done is not None else 0):
                on_layer_done(index)
        else:
            for index, layer in enumerate(self.layers):
                delta = layer.forward_fused(rope, delta, residual, kv_caches[index],
                                            slot_mappings[index], attn_metas[index])
                if on_layer_done is not None:
                    on_layer_done(index)
        return self.norm.add_and_norm(delta[logits_indices], residual[logits_indices])


def layer_windows(config) -> list[int]:
    """Per layer, its sliding window from the config (0: full attention): `layer_types` where
    the config has them, else Mistral's window on every layer (Qwen2's only with
    use_sliding_window)."""
    window = getattr(config, "sliding_window", None) or 0
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else 0 for kind in layer_types]
    return [window] * config.num_hidden_layers
