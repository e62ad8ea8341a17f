"""KV group layouts (kv_groups.py): equal-size groups of one window each, padded slots."""
from __future__ import annotations

import pytest

from kvrelay.engine.kv_groups import KVGroup, KVGroupLayout


def test_no_windows_is_one_group_of_every_layer_in_order():
    layout = KVGroupLayout.from_windows([0] * 5)
    assert layout.slots_per_block == 5 and layout.groups == (KVGroup(0, (0, 1, 2, 3, 4)),)
    assert layout.layer_slot == (0, 1, 2, 3, 4) and not layout.is_hybrid


def test_a_window_on_every_layer_is_one_window_group():
    layout = KVGroupLayout.from_windows([64] * 4)
    assert layout.windows == (64,) and layout.slots_per_block == 4


def test_five_local_to_one_global_groups_by_the_global_count():
    windows = ([32] * 5 + [0]) * 2  # Gemma 3's pattern, 12 layers: 10 local, 2 global
    layout = KVGroupLayout.from_windows(windows)
    assert layout.slots_per_block == 2
    assert layout.windows == (32, 32, 32, 32, 32, 0)
    assert layout.groups[2].layers == (4, 6) and layout.groups[4].layers == (9, 10)
    assert layout.groups[5].layers == (5, 11)
    assert (layout.layer_group[11], layout.layer_slot[11]) == (5, 1)
    # every layer has one (group, slot), and no two layers of a group share a slot
    pairs = set(zip(layout.layer_group, layout.layer_slot))
    assert len(pairs) == len(windows)


def test_a_count_that_is_no_multiple_of_the_size_pads_the_last_group():
    layout = KVGroupLayout.from_windows([8, 8, 8, 0, 0])  # 3 local, 2 global: P = 2
    assert layout.slots_per_block == 2
    assert [group.layers for group in layout.groups] == [(0, 1), (2,), (3, 4)]
    assert layout.windows == (8, 8, 0)


def test_negative_windows_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        KVGroupLayout.from_windows([0, -1])


def test_a_slot_streams_once_the_last_layer_using_it_has_run():
    layout = KVGroupLayout.from_windows(([32] * 5 + [0]) * 2)
    # slot 0: layers 0, 2, 4, 7, 9, 5; slot 1: layers 1, 3, 6, 8, 10, 11
    assert layout.slots_done_after() == {9: (0,), 11: (1,)}
    assert KVGroupLayout.from_windows([0] * 3).slots_done_after() == {0: (0,), 1: (1,), 2: (2,)}
    # a later slot that is ready first waits for the ones before it
    # (slot 0: layers 0, 2, 4; slot 1: layers 1, 3)
    assert KVGroupLayout.from_windows([0, 0, 8, 8, 8]).slots_done_after() == {4: (0, 1)}
