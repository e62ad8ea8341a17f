"""How a model's layers share the paged KV cache when some of them attend through a window.

Layers are split into groups of equal size P, each group's layers sharing one window (0: full
attention). One KV block holds the pages of P layer slots, and each sequence has one block table
per group: a window group's table keeps only the blocks its window can still reach, so a long
request on a model with window layers holds far fewer blocks than its length in those groups.
A window value whose layer count is not a multiple of P gets a last group with unused slots.

A model without windows (or with one window on every layer) is one group of all its layers:
block i of layer l is kv[l, :, i], exactly the layout of a cache without groups.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int  # keys a query sees (the last `window`), 0: all of them
    layers: tuple[int, ...]  # model layer indices, one per slot from slot 0 (fewer: padded)


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    slots_per_block: int  # P: layer slots in one block's pages
    groups: tuple[KVGroup, ...]
    layer_group: tuple[int, ...]  # per model layer: its group's index
    layer_slot: tuple[int, ...]  # per model layer: its slot in 0..P-1

    @classmethod
    def from_windows(cls, layer_windows: list[int]) -> "KVGroupLayout":
        """layer_windows: per layer, the window (0: full attention)."""
        if not layer_windows:
            raise ValueError("a model needs at least one layer")
        if any(window < 0 for window in layer_windows):
            raise ValueError(f"windows must be >= 0, got {layer_windows}")
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in by_window.values())
        groups = tuple(KVGroup(window, tuple(layers[start:start + size]))
                       for window, layers in by_window.items()
                       for start in range(0, len(layers), size))
        layer_group = [0] * len(layer_windows)
        layer_slot = [0] * len(layer_windows)
        for index, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                layer_group[layer], layer_slot[layer] = index, slot
        return cls(size, groups, tuple(layer_group), tuple(layer_slot))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def windows(self) -> tuple[int, ...]:
        """Per group, its window (0: full attention)."""
        return tuple(group.window for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def slots_done_after(self) -> dict[int, tuple[int, ...]]:
        """Model layer -> the slots whose pages every layer has stored once it has run (its
        step's KV of those slots is final), in slot order: a slot waits for the slots before
        it, so a stream of slots goes out in order."""
        last_layer = [max(group.layers[slot] for group in self.groups
                          if slot < len(group.layers))
                      for slot in range(self.slots_per_block)]
        done_after: dict[int, list[int]] = {}
        latest = -1
        for slot, layer in enumerate(last_layer):
            latest = max(latest, layer)
            done_after.setdefault(latest, []).append(slot)
        return {layer: tuple(slots) for layer, slots in done_after.items()}

    def describe(self) -> str:
        groups = ", ".join(f"{'window ' + str(group.window) if group.window else 'full'}: "
                           f"layers {list(group.layers)}" for group in self.groups)
        return (f"KV layout: {self.slots_per_block} layer slots per block, "
                f"{self.num_groups} group(s) ({groups})")


def single_group(num_layers: int) -> KVGroupLayout:
    """Every layer full attention: one group, one slot per layer."""
    return KVGroupLayout.from_windows([0] * num_layers)
