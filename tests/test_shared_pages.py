"""The shared KV cache file's pages are faulted in once, up front (services/engine/shared_pages.py):
a process that populated its mapping writes every page afterwards without a page fault, and the
data it maps is left as it was."""
from __future__ import annotations

import mmap
import os
import resource

import pytest
import torch

from services.engine import shared_pages
from services.engine.model_runner import allocate_kv_cache, map_kv_cache_file

SHAPE = (2, 2, 64, 16, 2, 64)  # [layers, K/V, blocks, block size, kv heads, head dim]: 1 MiB in bf16

_KERNEL = tuple(int(part) for part in os.uname().release.split(".")[:2])
pytestmark = pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _write_every_page(tensor: torch.Tensor) -> None:
    flat = tensor.view(-1)
    flat[:: mmap.PAGESIZE // flat.element_size()] = 1.0


def test_a_populated_cache_file_takes_no_fault_when_written(tmp_path):
    cache = allocate_kv_cache(SHAPE, torch.bfloat16, torch.device("cpu"), str(tmp_path / "w.kv"))
    assert not cache.any()  # zeros, as an anonymous cache starts
    before = _minor_faults()
    _write_every_page(cache)
    pages = cache.numel() * cache.element_size() // mmap.PAGESIZE
    assert _minor_faults() - before < pages // 4
    assert shared_pages.populate(cache)  # and again is harmless


def test_another_process_mapping_sees_the_owners_pages_and_takes_no_fault(tmp_path):
    path = str(tmp_path / "w.kv")
    owner = allocate_kv_cache(SHAPE, torch.bfloat16, torch.device("cpu"), path)
    owner[1, 0, 5].fill_(3.0)
    mapped = map_kv_cache_file(path, torch.bfloat16, (SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[5]))
    assert mapped.shape == SHAPE and (mapped[1, 0, 5] == 3.0).all() and mapped[0].sum() == 0
    before = _minor_faults()
    _write_every_page(mapped)
    assert _minor_faults() - before < mapped.numel() * 2 // mmap.PAGESIZE // 4
    assert (owner.view(-1)[:: mmap.PAGESIZE // 2] == 1.0).all()  # one file: the owner sees it
