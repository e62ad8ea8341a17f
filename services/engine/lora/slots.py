"""The adapters a model runner holds: every registered adapter's weights in host memory, and
`max_loras` slots in the model's LoRA tensors, filled on demand.

A step may carry tokens of up to `max_loras` adapters (the scheduler keeps each running set
within that); before it runs, each of its adapters is made resident in a slot, replacing the
least recently used adapter the step does not need, preferring one no live sequence holds.
Slot tensors live in every adapted linear (lora_linear.py); a slot is zeroed before it is
refilled, so no part of an earlier adapter survives in it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from kvrelay.engine.lora.adapter_files import LoRAAdapter, module_shapes
from kvrelay.engine.lora.lora_linear import LoRALinear, LoRAStep

BASE = 0  # the adapter id of the base model: no update

# adapter module name -> (the model linear it updates, the span name inside it)
_LINEAR_OF = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj",
              "v_proj": "self_attn.qkv_proj", "qkv_proj": "self_attn.qkv_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj",
              "up_proj": "mlp.gate_up_proj", "gate_up_proj": "mlp.gate_up_proj",
              "down_proj": "mlp.down_proj"}


class AdapterSlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device,
                 held_adapters: Callable[[], frozenset[int]] = frozenset) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.like = torch.empty(0, dtype=dtype, device=device)
        self.step = LoRAStep()
        self.linears = _wrap_linears(model, self.step)  # (layer, linear name) -> LoRALinear
        model.lora_step = self.step
        self.adapters: dict[int, LoRAAdapter] = {}  # adapter id -> weights (float32, host)
        self.slot_owner: list[int | None] = [None] * max_loras
        self.last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self.held_adapters = held_adapters  # the owner's live sequences' adapter ids
        self.retired: set[int] = set()  # unloaded, kept while live sequences hold them

    # ---- registry ------------------------------------------------------------------------------
    def add(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        if adapter_id == BASE or adapter_id in self.adapters:
            raise ValueError(f"adapter id {adapter_id} is taken")
        if adapter.rank > self.max_rank:
            raise ValueError(f"rank {adapter.rank} is above max_lora_rank {self.max_rank}")
        self.adapters[adapter_id] = adapter

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        self.retired.discard(adapter_id)
        if adapter_id in self.slot_owner:
            self._clear_slot(self.slot_owner.index(adapter_id))

    def retire(self, adapter_id: int) -> None:
        """Remove the adapter once no live sequence holds it (those running finish with it)."""
        if adapter_id in self.adapters:
            self.retired.add(adapter_id)
            self._drop_retired()

    def _drop_retired(self) -> None:
        if self.retired:
            held = self.held_adapters()
            for adapter_id in [i for i in self.retired if i not in held]:
                self.remove(adapter_id)

    def resident(self) -> list[int]:
        return [owner for owner in self.slot_owner if owner is not None]

    # ---- steps ---------------------------------------------------------------------------------
    def begin_step(self, token_adapters: np.ndarray | None) -> None:
        """token_adapters [T] int32: each token's adapter id (BASE for none), or None when no
        token has one."""
        if token_adapters is None:
            self.step.token_slots = None
            return
        wanted = [int(i) for i in np.unique(token_adapters) if i != BASE]
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step with {len(wanted)} adapters; max_loras is "
                             f"{self.max_loras}")
        held = self.held_adapters()
        slot_of = {adapter_id: self._make_resident(adapter_id, wanted, held)
                   for adapter_id in wanted}
        lookup = np.full(max(wanted) + 1, -1, dtype=np.int32)
        for adapter_id, slot in slot_of.items():
            lookup[adapter_id] = slot
        self.step.token_slots = torch.from_numpy(lookup[token_adapters]).to(self.like.device)

    def end_step(self) -> None:
        self.step.token_slots = None
        self._drop_retired()

    def _make_resident(self, adapter_id: int, wanted: list[int], held: frozenset[int]) -> int:
        if adapter_id not in self.adapters:
            raise KeyError(f"adapter {adapter_id} is not loaded on this worker")
        now = next(self._clock)
        if adapter_id in self.slot_owner:
            slot = self.slot_owner.index(adapter_id)
        else:
            slot = self._free_slot(wanted, held)
            self._fill_slot(slot, adapter_id)
        self.last_used[slot] = now
        return slot

    def _free_slot(self, wanted: list[int], held: frozenset[int]) -> int:
        """An empty slot, else the least recently used one whose adapter this step does not
        need, preferring adapters no live sequence holds."""
        if None in self.slot_owner:
            return self.slot_owner.index(None)
        candidates = [slot for slot, owner in enumerate(self.slot_owner) if owner not in wanted]
        return min(candidates, key=lambda slot: (self.slot_owner[slot] in held,
                                                 self.last_used[slot]))

    def _fill_slot(self, slot: int, adapter_id: int) -> None:
        if self.slot_owner[slot] is not None:
            self._clear_slot(slot)
        adapter = self.adapters[adapter_id]
        for (layer, target), pair in adapter.modules.items():
            linear = self.linears[(layer, _LINEAR_OF[target])]
            part = linear.part(target, self.max_loras, self.max_rank, self.like)
            rank = pair.a.shape[0]
            part.a[slot, :rank].copy_(pair.a)
            part.b_t[slot, :rank].copy_(pair.b.t())
            part.slots_in_use.add(slot)
            linear.refresh_active()
        self.slot_owner[slot] = adapter_id

    def _clear_slot(self, slot: int) -> None:
        for linear in self.linears.values():
            for part in linear.parts.values():
                if slot in part.slots_in_use:
                    part.a[slot].zero_()
                    part.b_t[slot].zero_()
                    part.slots_in_use.discard(slot)
            linear.refresh_active()
        self.slot_owner[slot] = None


def _wrap_linears(model: nn.Module, step: LoRAStep) -> dict[tuple[int, str], LoRALinear]:
    """Put a LoRALinear around every linear an adapter may target (not the experts of a
    mixture-of-experts layer), in place."""
    shapes = module_shapes(model.spec)
    spans = _spans(shapes)
    linears = {}
    for index, layer in enumerate(model.layers):
        for linear_name, linear_spans in spans.items():
            block_name, attr = linear_name.split(".")
            if block_name == "mlp" and model.spec.moe_layers[index]:
                continue
            block = getattr(layer, block_name)
            base = getattr(block, attr)
            in_features = shapes[next(iter(linear_spans))][1]
            wrapped = LoRALinear(base, in_features, linear_spans, step)
            setattr(block, attr, wrapped)
            linears[(index, linear_name)] = wrapped
    return linears


def _spans(shapes: dict) -> dict[str, dict[str, tuple[int, int]]]:
    """Per model linear: each adapter module name -> the output columns it updates (q, k, v
    side by side in qkv_proj, gate then up in gate_up_proj, as the model fuses them)."""
    spans: dict[str, dict[str, tuple[int, int]]] = {}
    offsets: dict[str, int] = {}
    for target in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        linear, size = _LINEAR_OF[target], shapes[target][2]
        offset = offsets.get(linear, 0)
        spans.setdefault(linear, {})[target] = (offset, size)
        offsets[linear] = offset + size
    spans["self_attn.qkv_proj"]["qkv_proj"] = (0, shapes["qkv_proj"][2])
    spans["mlp.gate_up_proj"]["gate_up_proj"] = (0, shapes["gate_up_proj"][2])
    return spans
