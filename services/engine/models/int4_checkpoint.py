"""A GPTQ or AWQ checkpoint read as the model loader reads any other (weights.py): each quantized
linear becomes its dequantized float32 `weight` (exact: a 4-bit code times a float16 scale),
and its 4-bit form is kept, so that small steps multiply the checkpoint's own codes
(small_steps.py, as for a GGUF's Q4 blocks) while larger ones run on the dequantized copy.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvrelay.engine.models import gguf_int4
from kvrelay.engine.models.quant_schemes import Int4Scheme
from kvrelay.engine.models.int4_unpack import Int4Tensor, unpack
from kvrelay.engine.models.weights import iter_checkpoint

log = logging.getLogger(__name__)

_PARTS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
# our fused matmuls -> the checkpoint's linears (canonical names) they are made of, in order;
# a checkpoint that holds the fused linear itself (Phi-3) is taken whole
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


class Int4Checkpoint:
    """`tensors()` yields (checkpoint name, tensor) with each quantized module's parts replaced
    by `<module>.weight`; afterwards `unpacked` holds each module's Int4Tensor by canonical
    name (the family's `rename` applied, `model.` dropped, as weights.py names parameters)."""

    def __init__(self, model_dir: Path, scheme: Int4Scheme,
                 rename: Callable[[str], str] = lambda name: name) -> None:
        self.model_dir = model_dir
        self.scheme = scheme
        self.rename = rename
        self.unpacked: dict[str, Int4Tensor] = {}

    def tensors(self, keep: Callable[[str], bool] = lambda canonical: True
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """keep(canonical module name): whether this process holds the module (a pipeline
        stage: its layers'); the others are neither unpacked nor dequantized."""
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in iter_checkpoint(self.model_dir):
            module, _, part = name.rpartition(".")
            if part in _PARTS:
                if keep(self.rename(module.removeprefix("model."))):
                    modules.setdefault(module, {})[part] = tensor
            else:
                yield name, tensor
        for module, parts in modules.items():  # parts of one module may span shards
            if "qweight" not in parts:
                raise ValueError(f"{module}: {', '.join(sorted(parts))} without a qweight")
            int4 = unpack(self.scheme, module, parts)
            self.unpacked[self.rename(module.removeprefix("model."))] = int4
            yield f"{module}.weight", int4.dequantized()

    def layer_blocks(self, layers: range) -> dict[str, gguf_int4.Q4Blocks] | None:
        """The 4-bit blocks of each layer matmul that has them, by our parameter name
        ("layers.3.mlp.down_proj"), or None where none has. Those without (a linear left
        unquantized, MoE experts, a size that is not whole 32-input blocks, fused parts in
        different orders) run every step on the dequantized weights; the log counts them."""
        blocks, without = {}, []
        for layer in layers:  # every layer, or a pipeline stage's
            for fused, pieces in FUSED.items():
                name = f"layers.{layer}.{fused}"
                found = self._fused(name, [f"layers.{layer}.{piece}" for piece in pieces])
                if found is None:
                    without.append(name)
                else:
                    blocks[name] = found
        if without:
            log.info("%s: %d of %d layer matmuls run small steps on their 4-bit blocks; the "
                     "rest on the dequantized weights (%s%s)", self.scheme.describe(),
                     len(blocks), len(blocks) + len(without), ", ".join(without[:4]),
                     ", ..." if len(without) > 4 else "")
        return blocks or None

    def _fused(self, fused_name: str, piece_names: list[str]) -> gguf_int4.Q4Blocks | None:
        if fused_name in self.unpacked:
            return self.unpacked[fused_name].to_q4_blocks()
        if not all(piece in self.unpacked for piece in piece_names):
            return None
        parts = [self.unpacked[piece].to_q4_blocks() for piece in piece_names]
        if any(part is None for part in parts):
            return None
        return gguf_int4.concat(parts)
