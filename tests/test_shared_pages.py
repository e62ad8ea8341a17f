"""The shared KV cache file's pages are allocated and faulted in once, up front
(services/engine/shared_pages.py): a process that populated its mapping writes every page
afterwards without a page fault, the data it maps is left as it was, and a filesystem without
room for the cache fails its allocation with a message instead of a SIGBUS later."""
from __future__ import annotations

import mmap
import os
import resource
import subprocess

import pytest
import torch

from kvrelay.engine import shared_pages
from kvrelay.engine.kv_pages import map_kv_pages
from kvrelay.engine.model_runner import allocate_kv_cache

SHAPE = (2, 2, 64, 16, 2, 64)  # [layers, K/V, blocks, block size, kv heads, head dim]: 1 MiB in bf16

_KERNEL = tuple(int(part) for part in os.uname().release.split(".")[:2])
needs_populate = pytest.mark.skipif(_KERNEL < (5, 14),
                                    reason="MADV_POPULATE_WRITE needs Linux 5.14")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _write_every_page(tensor: torch.Tensor) -> None:
    flat = tensor.view(-1)
    flat[:: mmap.PAGESIZE // flat.element_size()] = 1.0


@needs_populate
def test_a_populated_cache_file_takes_no_fault_when_written(tmp_path):
    cache = allocate_kv_cache(SHAPE, torch.bfloat16, torch.device("cpu"), str(tmp_path / "w.kv"))
    assert not cache.any()  # zeros, as an anonymous cache starts
    before = _minor_faults()
    _write_every_page(cache)
    pages = cache.numel() * cache.element_size() // mmap.PAGESIZE
    assert _minor_faults() - before < pages // 4
    assert shared_pages.populate(cache)  # and again is harmless


@needs_populate
def test_another_process_mapping_sees_the_owners_pages_and_takes_no_fault(tmp_path):
    path = str(tmp_path / "w.kv")
    owner = allocate_kv_cache(SHAPE, torch.bfloat16, torch.device("cpu"), path)
    owner[1, 0, 5].fill_(3.0)
    mapped = map_kv_pages(path, torch.bfloat16, (SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[5])).shards[0]
    assert mapped.shape == SHAPE and (mapped[1, 0, 5] == 3.0).all() and mapped[0].sum() == 0
    before = _minor_faults()
    _write_every_page(mapped)
    assert _minor_faults() - before < mapped.numel() * 2 // mmap.PAGESIZE // 4
    assert (owner.view(-1)[:: mmap.PAGESIZE // 2] == 1.0).all()  # one file: the owner sees it


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, like a container's small /dev/shm (needs the right to mount: root)."""
    directory = tmp_path / "shm"
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


def test_a_cache_too_large_for_its_tmpfs_fails_at_allocation_with_the_room_it_needs(small_tmpfs):
    path = small_tmpfs / "w.kv"
    with pytest.raises(shared_pages.CacheSpaceError,
                       match=r"needs 2\.0 MiB in .*shm, which has 1\.0 MiB free.*--shm-dir"):
        allocate_kv_cache((2,) + SHAPE, torch.bfloat16, torch.device("cpu"), str(path))
    assert not path.exists()  # and the room it did take is given back
    cache = allocate_kv_cache(SHAPE, torch.bfloat16, torch.device("cpu"), str(path))
    cache.view(-1)[-1] = 1.0  # a cache that fits is writable to its last page
    assert cache.view(-1)[-1] == 1.0 and os.statvfs(small_tmpfs).f_bavail == 0
