"""Gemma 3 (text): Gemma 2's layer with (1 + w) RMSNorms over each q and k head, and local
(sliding) and global layers with rope parameters of their own (`rope_parameters` per layer
type: a smaller base on the local layers, scaling on the global ones)."""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec, dense_spec
from kvrelay.engine.models.gemma2 import gemma_options
from kvrelay.engine.models.rope import rope_keys

ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text"}


def spec(config) -> ArchSpec:
    return dense_spec(config, qk_norm=True, layer_ropes=rope_keys(config),
                      **gemma_options(config))
