"""The decoder layers of a small decode step in one native call (kernels/native_stack.py).

Attached where every ingredient of the Python path's native small steps is there: bf16 on
CPU, the fused elementwise ops, the native decode attention, and each layer's four matmuls on
the 4-bit kernel (a GGUF source) or on bf16 tiles (a bf16 checkpoint). Every dense family's
layer runs in it (the options are models/arch.py's); mixture-of-experts layers and partial
rotary embeddings do not. It takes a step when every row is a decode row (a speculative step's drafts
are decode rows too) and there are at most `max_rows` of them: up to `gemv_max_rows` its
matmuls run on the native gemv kernel, above that (where given) on the VNNI kernel's tiles, and
above those (where given) on AMX tiles from the same 4-bit tiles, as the Python path picks them;
anything else runs layer by layer as before. The result is the
Python path's bit for bit: the same kernels in the same order.
"""
from __future__ import annotations

import torch

from kvrelay.kernels import kv_quant, native_cpu
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.engine.models.gguf_int4 import FUSED

MATMULS = tuple(FUSED)  # qkv_proj, o_proj, gate_up_proj, down_proj: the kernel's order


class DecodeStack:
    def __init__(self, ops, model, tiles: dict, gemv_max_rows: int, vnni_tiles: dict | None = None,
                 vnni_max_rows: int = 0, amx_max_rows: int = 0,
                 bf16_tiles: dict | None = None) -> None:
        """tiles: parameter name ("layers.3.mlp.down_proj") -> native_amx.Q4Tiles, for steps of
        up to gemv_max_rows rows; vnni_tiles: the same names -> native_q4a8.Q4A8Tiles, for the
        steps above, up to vnni_max_rows (None: none); amx_max_rows: the steps above those, on
        AMX tiles from `tiles` (0: none). A bf16 checkpoint gives no tiles but bf16_tiles (the
        same names -> native_amx.pack_bf16 tiles), for the gemv kernel's steps only."""
        spec = model.spec
        attention = model.layers[0].self_attn
        num_layers = len(model.layers)
        self.native = ops.DecodeStack(
            norms=[norm.weight.detach() for layer in model.layers for norm in _norms(layer, spec)],
            tiles=_in_order(tiles, num_layers, lambda t: t.tiles),
            vnni_tiles=_in_order(vnni_tiles or {}, num_layers, lambda t: t.tiles),
            bf16_tiles=[] if tiles else _in_order(bf16_tiles or {}, num_layers, lambda t: t),
            qkv_biases=[layer.self_attn.qkv_proj.bias.detach() for layer in model.layers]
            if spec.qkv_bias else [],
            windows=list(spec.layer_windows),
            gemv_max_rows=gemv_max_rows, vnni_max_rows=vnni_max_rows if vnni_tiles else 0,
            amx_max_rows=amx_max_rows, num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
            intermediate=model.layers[0].mlp.intermediate_size, eps=spec.rms_norm_eps,
            scale=attention.scale, norm_offset=spec.norm_offset, sandwich=spec.sandwich_norms,
            qk_norm=spec.qk_norm, gelu=spec.activation == "gelu_tanh",
            soft_cap=spec.attn_soft_cap or 0.0)
        self.rope_keys = list(spec.layer_ropes)
        self.max_rows = max(gemv_max_rows, vnni_max_rows if vnni_tiles else 0, amx_max_rows)

    @staticmethod
    def fits(model, tiles: dict) -> bool:
        """Whether the model is one the stack runs: a dense family's layers (no experts, the
        whole head dim rotated, no o bias), every layer matmul on `tiles` (4-bit or bf16), the
        native norms and decode attention in use, and the whole model in this process (a
        tensor-parallel shard sums its layers' outputs across ranks between the layers, which
        the one native call cannot)."""
        spec = model.spec
        return (model.tp.size == 1 and model.whole and spec.moe is None
                and spec.rotary_dim in (None, spec.head_dim) and not spec.o_bias
                and spec.activation in ("silu", "gelu_tanh")
                and all(name in tiles for name in matmul_names(len(model.layers)))
                and model.norm.native is not None
                and native_cpu.paged_decode_op() is not None)

    def takes(self, num_tokens: int, attn_meta: AttentionMetadata,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this step is the stack's: decode rows only, few enough, on the caches the
        native store and attention read: bf16 rows, or 8-bit codes (which they rotate and code
        themselves, kv_codes.h). The Python path falls back to torch's otherwise."""
        plan = attn_meta.cpu_plan
        k_cache = kv_caches[0][0]
        return (num_tokens <= self.max_rows and plan is not None and plan.prefill_rows is None
                and plan.decode.num_rows == num_tokens and k_cache.is_contiguous()
                and (k_cache.dtype == torch.bfloat16 or kv_quant.format_of(k_cache) is not None))

    def run(self, residual: torch.Tensor, ropes: dict, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            slot_mappings: list[torch.Tensor], attn_metas: list[AttentionMetadata]) -> torch.Tensor:
        """residual [T, hidden] bf16, updated in place; ropes: rope key -> cos, sin
        [T, 1, head_dim]; per layer its cache, slots and metadata (its KV group's). Returns the
        last layer's MLP output [T, hidden] (not yet added to residual)."""
        rows = attn_metas[0].cpu_plan.decode
        layer_ropes = [ropes[key] for key in self.rope_keys]
        return self.native.run(residual, [cos for cos, _ in layer_ropes],
                               [sin for _, sin in layer_ropes], [k for k, _ in kv_caches],
                               [v for _, v in kv_caches], slot_mappings, rows.token_ids,
                               rows.seq_lens,
                               [meta.cpu_plan.decode.block_tables for meta in attn_metas])


def _norms(layer, spec) -> list:
    """A layer's norms in the kernel's order: input, post-attention, then pre- and
    post-feedforward (sandwich norms), then q and k (q/k norms)."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if spec.sandwich_norms:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if spec.qk_norm:
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return norms


def matmul_names(num_layers: int) -> list[str]:
    """Every layer matmul's parameter name, in the order the kernel takes their weights."""
    return [f"layers.{index}.{name}" for index in range(num_layers) for name in MATMULS]


def _in_order(tiles: dict, num_layers: int, tensor_of) -> list[torch.Tensor]:
    return [tensor_of(tiles[name]) for name in matmul_names(num_layers)] if tiles else []
