"""Any decoder family over a flat varlen batch, built from its ArchSpec and the shared layers.

Tokens of all sequences in a step are concatenated ([num_tokens, hidden]); attention reads and
writes the paged KV cache through kernels/. No padding, and logits only for sampled rows.
q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs run faster.
Each layer gets its own KV cache, slot mapping and attention metadata (layers with a window,
or in another KV group, see other ones).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.engine.models.arch import ArchSpec
from kvrelay.engine.models.decode_stack import DecodeStack
from kvrelay.engine.models.layers.attention import Attention
from kvrelay.engine.models.layers.mlp import GatedMLP
from kvrelay.engine.models.layers.moe import SparseMoE
from kvrelay.engine.models.layers.norm import RMSNorm
from kvrelay.engine.models.packed_linear import PackedLinear, pack_linears_
from kvrelay.engine.parallel.group import TPGroup
from kvrelay.engine.models.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V [num_blocks, block_size, kv_heads, head_dim]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, index: int, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.tp = tp  # o_proj and down_proj hold input columns: their outputs are summed
        self.window = spec.layer_windows[index]
        self.rope_key = spec.layer_ropes[index]
        self.self_attn = Attention(spec)
        self.mlp = (SparseMoE(spec.hidden_size, spec.moe, spec.activation)
                    if spec.moe_layers[index] else
                    GatedMLP(spec.hidden_size, spec.intermediate_size, spec.activation))
        norm = lambda: RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = spec.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm normalises the attention's output
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm before the MLP (transformers names it differently with sandwich norms)."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def _attention(self, rope, normed, kv_cache, slot_mapping, attn_meta) -> torch.Tensor:
        out = self.tp.all_reduce_(self.self_attn(rope, normed, kv_cache, slot_mapping,
                                                 attn_meta))
        return self.post_attention_layernorm(out) if self.sandwich else out

    def _mlp(self, normed: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce_(self.mlp(normed))
        return self.post_feedforward_layernorm(out) if self.sandwich else out

    def forward(self, rope, hidden, kv_cache, slot_mapping, attn_meta) -> torch.Tensor:
        hidden = hidden + self._attention(rope, self.input_layernorm(hidden), kv_cache,
                                          slot_mapping, attn_meta)
        return hidden + self._mlp(self.mlp_norm(hidden))

    def forward_fused(self, rope, delta: torch.Tensor | None, residual: torch.Tensor, kv_cache,
                      slot_mapping, attn_meta) -> torch.Tensor:
        """The same layer with each skip connection's add fused into the norm after it (native
        ops): the residual stream is `residual + delta` (delta None on the first layer), updated
        in place; returns this layer's MLP output, the next delta."""
        if delta is None:
            normed = self.input_layernorm(residual)
        else:
            normed = self.input_layernorm.add_and_norm(delta, residual)
        attn_out = self._attention(rope, normed, kv_cache, slot_mapping, attn_meta)
        return self._mlp(self.mlp_norm.add_and_norm(attn_out, residual))


class ElsewhereLayer(nn.Module):
    """A layer another pipeline stage runs: holds nothing here."""


class DecoderLM(nn.Module):
    """A family's causal LM; `config` is the Hugging Face config, `spec` what the family read
    from it (models/<family>.py). Under tensor parallelism (`tp` of more than one rank) `spec`
    is this rank's shard's (parallel/shard.py): its heads, intermediate columns and vocabulary
    rows. A pipeline stage (`stage_layers` some of the layers) holds only those; the first
    stage also holds the embedding, the final norm and the head (it samples), the others none
    of them (parallel/pipeline.py)."""

    def __init__(self, config, spec: ArchSpec, tp: TPGroup = TPGroup(),
                 stage_layers: range | None = None) -> None:
        super().__init__()
        self.config = config
        self.spec = spec
        self.tp = tp
        self.stage_layers = range(spec.num_layers) if stage_layers is None else stage_layers
        self.holds_ends = self.stage_layers.start == 0  # embedding, final norm, head
        self.ropes = nn.ModuleDict({key: RotaryEmbedding(config, key, spec.rotary_dim)
                                    for key in dict.fromkeys(spec.layer_ropes)})
        self.layers = nn.ModuleList(DecoderLayer(spec, index, tp)
                                    if index in self.stage_layers else ElsewhereLayer()
                                    for index in range(spec.num_layers))
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.embed_tokens = self.norm = self.lm_head = None
        if self.holds_ends:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
            if not self.tie_word_embeddings:
                self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.packed_head: PackedLinear | None = None
        # every layer of a small decode step in one native call (decode_stack.py), if attached
        self.decode_stack: DecodeStack | None = None
        self.fused_layers = False  # the layers' skip adds fused into the norms (native ops)
        # with LoRA adapters (engine/lora/slots.py): the running step's token -> slot map
        self.lora_step = None

    @property
    def whole(self) -> bool:
        """Every layer in this process (no pipeline stages)."""
        return len(self.stage_layers) == self.spec.num_layers

    @property
    def layer_windows(self) -> list[int]:
        return list(self.spec.layer_windows)

    def reset_rope_tables_(self) -> None:
        """cos/sin in float32 on the CPU (buffers built on the meta device hold nothing)."""
        for rope in self.ropes.values():
            rope.reset_tables()

    def rope_tables_to_(self, device: torch.device) -> None:
        for rope in self.ropes.values():  # kept float32 whatever the model's dtype
            rope.cos_table, rope.sin_table = rope.cos_table.to(device), rope.sin_table.to(device)

    def use_native_cpu_ops_(self, ops) -> None:
        """Route norms, rope and the MLP's activation to the fused CPU kernels (one pass each)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, GatedMLP)):
                module.native = ops
        self.fused_layers = True

    def torch_fallbacks(self) -> list[str]:
        """What this family runs on torch ops where Llama's layers run fused native ones
        (bf16 on CPU), to say once at start."""
        spec, fallbacks = self.spec, []
        if spec.rotary_dim is not None and spec.rotary_dim < spec.head_dim:
            fallbacks.append("partial rotary embedding")
            if spec.qk_norm:
                fallbacks.append("q/k norms")
        return fallbacks

    @property
    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def pack_for_cpu_(self) -> None:
        """After loading bf16 weights on CPU: pre-pack every matmul's weight for oneDNN (the
        experts' too)."""
        if self.holds_ends:
            self.packed_head = PackedLinear(self.head_weight, None)
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.experts.prepare_for_cpu_()
        # the routers stay plain: they run in float32 (layers/moe.py)
        pack_linears_(self.layers, skip_parent=lambda parent: isinstance(parent, SparseMoE))

    def add_small_step_kernels_(self, max_rows: int, layer_matmuls: dict,
                                head_matmul: Callable | None) -> None:
        """Steps of at most max_rows tokens run on other kernels (small_steps.py):
        layer_matmuls maps parameter name ("layers.3.mlp.down_proj") -> its matmul."""
        for name, module in self.named_modules():
            if name in layer_matmuls:
                module.add_small_step_kernel_(max_rows, layer_matmuls[name])
        if head_matmul is not None and self.packed_head is not None:
            self.packed_head.add_small_step_kernel_(max_rows, head_matmul)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if self.tp.size == 1 else \
            self._embed_vocab_parallel(input_ids)
        if self.spec.embed_scale != 1.0:  # rounded to the dtype first, as transformers does
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], slot_mappings: list[torch.Tensor],
                attn_metas: list[AttentionMetadata], logits_indices: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        # input_ids, positions [T]; per layer: kv_caches, slot_mappings [T], attn_metas;
        # logits_indices [S] rows to sample -> [S, vocab] float32.
        return self.logits_of(self.final_hidden(input_ids, positions, kv_caches, slot_mappings,
                                                attn_metas, logits_indices, on_layer_done))

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[KVCache], slot_mappings: list[torch.Tensor],
                     attn_metas: list[AttentionMetadata], row_indices: torch.Tensor,
                     on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """The final norm's output for rows row_indices [R] -> [R, hidden] (forward's args).
        on_layer_done(i) runs once layer i's KV for this step is stored (the KV connector
        starts pushing that layer while later layers compute)."""
        residual, delta = self.run_layers(self.embed(input_ids), None, positions, kv_caches,
                                          slot_mappings, attn_metas, on_layer_done)
        return self.final_norm(residual[row_indices],
                               None if delta is None else delta[row_indices])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self._embed(input_ids)

    def run_layers(self, residual: torch.Tensor, delta: torch.Tensor | None,
                   positions: torch.Tensor, kv_caches: list[KVCache],
                   slot_mappings: list[torch.Tensor], attn_metas: list[AttentionMetadata],
                   on_layer_done: Callable[[int], None] | None = None):
        """This stage's layers over the residual stream [T, hidden]: `residual + delta` (delta
        None: residual alone; fused layers keep the last add for the norm after it, unfused
        ones never leave one). residual is updated in place. Returns (residual, delta).
        Per-layer lists are indexed by model layer."""
        ropes = {key: rope.tables_for(positions, residual.dtype)
                 for key, rope in self.ropes.items()}
        if self.fused_layers:
            return self._layers_fused(ropes, residual, delta, kv_caches, slot_mappings,
                                      attn_metas, on_layer_done)
        hidden = residual if delta is None else residual + delta
        for index in self.stage_layers:
            layer = self.layers[index]
            hidden = layer(ropes[layer.rope_key], hidden, kv_caches[index],
                           slot_mappings[index], attn_metas[index])
            if on_layer_done is not None:
                on_layer_done(index)
        return hidden, None

    def final_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final norm of rows of the residual stream (+ the last layer's output, where
        fused) [R, hidden] -> [R, hidden]."""
        if delta is None:
            return self.norm(residual)
        return self.norm.add_and_norm(delta, residual)

    def _adapters_in_step(self) -> bool:
        """Whether a LoRA adapter updates this step (the one-call stack computes none)."""
        return self.lora_step is not None and self.lora_step.token_slots is not None

    def _embed_vocab_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the tokens of its vocabulary rows (zeros for the others); the
        sum over the ranks is every token's embedding."""
        first = self.tp.rank * self.spec.vocab_size
        local = input_ids - first
        outside = (local < 0) | (local >= self.spec.vocab_size)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce_(hidden)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] f32
        if self.packed_head is not None:
            logits = self.packed_head(hidden).float()
        else:
            logits = F.linear(hidden, self.head_weight).float()
        logits = self.tp.all_gather_columns(logits)  # the ranks' vocabulary rows, in order
        cap = self.spec.final_soft_cap
        return torch.tanh(logits / cap) * cap if cap else logits

    def _layers_fused(self, ropes, residual, delta, kv_caches, slot_mappings, attn_metas,
                      on_layer_done):
        """The layers with each skip add fused into the norm after it; returns (residual,
        the last layer's output): the final add is left to the final norm, which only the
        sampled rows need."""
        stack = self.decode_stack
        if stack is not None and delta is None and self.whole and \
                not self._adapters_in_step() and \
                stack.takes(residual.shape[0], attn_metas[0], kv_caches):
            delta = stack.run(residual, ropes, kv_caches, slot_mappings, attn_metas)
            # every layer's K/V is stored by now: a push that waits on them starts at once
            # (the stack's steps are a few tokens, so little overlap is lost)
            for index in range(len(self.layers) if on_layer_done is not None else 0):
                on_layer_done(index)
            return residual, delta
        for index in self.stage_layers:
            layer = self.layers[index]
            delta = layer.forward_fused(ropes[layer.rope_key], delta, residual,
                                        kv_caches[index], slot_mappings[index],
                                        attn_metas[index])
            if on_layer_done is not None:
                on_layer_done(index)
        return residual, delta
