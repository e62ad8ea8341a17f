"""A pipeline stage's share of the model: the KV cache of its layers and the checkpoint tensors
of its layers (and, on the first stage, the embedding, the final norm and the head).

A block's pages hold every layer slot (kv_groups.py); a stage's layers use a run of the slots.
Where the group shares a cache file (a worker: the KV connector reads and writes every layer's
pages through the leader) the file holds the whole cache, one rank's layout, and each stage maps
it and faults in only its own slots; the leader maps it whole. Otherwise (offline, or stages on
other hosts) each stage allocates the run of slots its layers use and nothing else, and the
connector writes through the leader, which sends the other stages their pages
(staged_pages.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from kvrelay.engine import shared_pages
from kvrelay.engine.kv_groups import KVGroupLayout
from kvrelay.engine.kv_pages import KvPages
from kvrelay.engine.parallel.group_kv import all_or_none
from kvrelay.engine.parallel.staged_pages import StagedKvPages

_LAYER = re.compile(r"^layers\.(\d+)\.")


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             path: str | None, pp, layout: KVGroupLayout):
    """Every stage calls this together. shape: the whole cache [slots, 2, num_blocks,
    block_size, kv_heads, row_width]. Returns (this stage's cache tensor, per model layer its
    (K, V) or None for another stage's layer, the leader's KvPages or None)."""
    first, last = slot_run(layout, pp.layers)
    if path is None:
        from kvrelay.engine.model_runner import allocate_kv_cache
        cache = allocate_kv_cache((last - first + 1, *shape[1:]), dtype, device, None)
        pages = _staged_pages(cache, first, layout, pp) if pp.is_leader else None
    else:
        whole = _map_whole(shape, dtype, path, pp.is_leader)
        shared_pages.populate(whole[first:last + 1].view(torch.uint8).view(-1))
        dist.barrier()  # every stage has mapped it: the owner may unlink a private file now
        cache = whole[first:last + 1]
        pages = KvPages.whole(whole) if pp.is_leader else None
    kv_caches = [(cache[slot - first][0], cache[slot - first][1]) if layer in pp.layers
                 else None for layer, slot in enumerate(layout.layer_slot)]
    return cache, kv_caches, pages


def slot_run(layout: KVGroupLayout, layers: range) -> tuple[int, int]:
    """The first and last slot the layers use (a run: the stage holds those between)."""
    slots = [layout.layer_slot[layer] for layer in layers]
    return min(slots), max(slots)


def slots_held(layout: KVGroupLayout, stages: tuple[range, ...]) -> set[int]:
    """The slots the stages hold between them (each its run)."""
    held = set()
    for layers in stages:
        first, last = slot_run(layout, layers)
        held.update(range(first, last + 1))
    return held


def _staged_pages(cache: torch.Tensor, first: int, layout: KVGroupLayout,
                  pp) -> StagedKvPages:
    """The leader's pages where the stages share no file: its own slots, the others' sent on
    (staged_pages.py)."""
    remote = slots_held(layout, pp.every_stage_layers[1:])
    return StagedKvPages(KvPages.whole(cache), first, layout.slots_per_block, remote)


def _map_whole(shape: tuple[int, ...], dtype: torch.dtype, path: str,
               is_leader: bool) -> torch.Tensor:
    num_bytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    problem = None
    if is_leader:
        try:  # pages committed now: a filesystem without room fails here, on every stage
            shared_pages.reserve(path, num_bytes)
        except OSError as exc:
            problem = exc
    all_or_none(problem)
    cache = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    return cache.view(dtype).view(shape)


def stage_tensors(tensors: Iterable[tuple[str, torch.Tensor]], rename, model):
    """The checkpoint's (name, tensor) pairs this stage's model holds."""
    for name, tensor in tensors:
        if held(rename(name.removeprefix("model.")), model):
            yield name, tensor


def held(canonical: str, model) -> bool:
    """Whether this stage's model holds a tensor or module (by canonical name): its layers',
    and the embedding, final norm and head where it holds them."""
    match = _LAYER.match(canonical)
    if match is not None:
        return int(match.group(1)) in model.stage_layers
    return model.holds_ends or "rotary_emb" in canonical
