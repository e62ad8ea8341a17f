"""The decoder layers of a small decode step in one native call (kernels/native_stack.py).

Attached where every ingredient of the Python path's native small steps is there: bf16 on
CPU, the fused elementwise ops, the native decode attention, and each layer's four matmuls on
the 4-bit kernel. It takes a step when every row is a decode row (a speculative step's drafts
are decode rows too) and there are at most `max_rows` of them: up to `gemv_max_rows` its
matmuls run on the native gemv kernel, above that (where given) on the VNNI kernel's tiles, and
above those (where given) on AMX tiles from the same 4-bit tiles, as the Python path picks them;
anything else runs layer by layer as before. The result is the
Python path's bit for bit: the same kernels in the same order.
"""
from __future__ import annotations

import torch

from kvrelay.kernels import native_cpu
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.engine.models.gguf_int4 import FUSED

MATMULS = tuple(FUSED)  # qkv_proj, o_proj, gate_up_proj, down_proj: the kernel's order


class DecodeStack:
    def __init__(self, ops, model, tiles: dict, gemv_max_rows: int, vnni_tiles: dict | None = None,
                 vnni_max_rows: int = 0, amx_max_rows: int = 0) -> None:
        """tiles: parameter name ("layers.3.mlp.down_proj") -> native_amx.Q4Tiles, for steps of
        up to gemv_max_rows rows; vnni_tiles: the same names -> native_q4a8.Q4A8Tiles, for the
        steps above, up to vnni_max_rows (None: none); amx_max_rows: the steps above those, on
        AMX tiles from `tiles` (0: none)."""
        config = model.config
        attention = model.layers[0].self_attn
        norms = []
        for layer in model.layers:
            norms += [layer.input_layernorm.weight.detach(),
                      layer.post_attention_layernorm.weight.detach()]
        self.native = ops.DecodeStack(norms, _in_order(tiles, len(model.layers)),
                                      _in_order(vnni_tiles or {}, len(model.layers)),
                                      gemv_max_rows, vnni_max_rows if vnni_tiles else 0,
                                      amx_max_rows, attention.num_heads, attention.num_kv_heads,
                                      attention.head_dim, config.intermediate_size,
                                      config.rms_norm_eps, attention.scale)
        self.max_rows = max(gemv_max_rows, vnni_max_rows if vnni_tiles else 0, amx_max_rows)

    @staticmethod
    def fits(model, tiles: dict) -> bool:
        """Whether the model is one the stack runs: Llama's own layers (no window, soft-cap,
        extra norms...), every layer matmul on 4-bit tiles, no biases, the native norms and
        decode attention in use."""
        return (model.spec.plain and all(name in tiles for name in matmul_names(len(model.layers)))
                and all(layer.self_attn.qkv_proj.bias is None for layer in model.layers)
                and model.norm.native is not None
                and native_cpu.paged_decode_op() is not None)

    def takes(self, num_tokens: int, attn_meta: AttentionMetadata,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this step is the stack's: decode rows only, few enough, on the caches the
        native store and attention read (the Python path falls back to torch's otherwise)."""
        plan = attn_meta.cpu_plan
        k_cache = kv_caches[0][0]
        return (num_tokens <= self.max_rows and plan is not None and plan.prefill_rows is None
                and plan.decode.num_rows == num_tokens and k_cache.dtype == torch.bfloat16
                and k_cache.is_contiguous())

    def run(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
            attn_meta: AttentionMetadata) -> torch.Tensor:
        """residual [T, hidden] bf16, updated in place; rope: cos, sin [T, 1, head_dim].
        Returns the last layer's MLP output [T, hidden] (not yet added to residual)."""
        rows = attn_meta.cpu_plan.decode
        return self.native.run(residual, *rope, [k for k, _ in kv_caches],
                               [v for _, v in kv_caches], slot_mapping, rows.token_ids,
                               rows.seq_lens, rows.block_tables)


def matmul_names(num_layers: int) -> list[str]:
    """Every layer matmul's parameter name, in the order the kernel takes their weights."""
    return [f"layers.{index}.{name}" for index in range(num_layers) for name in MATMULS]


def _in_order(tiles: dict, num_layers: int) -> list[torch.Tensor]:
    return [tiles[name].tiles for name in matmul_names(num_layers)] if tiles else []
