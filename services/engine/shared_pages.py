"""A shared KV cache file's pages, faulted in up front.

The decode worker's cache lives in a /dev/shm file (the shm KV transport writes pages straight
into it), created sparse: every 4 KB page was allocated and zeroed on its first write, and each
process mapping the file took a page fault on its first touch of each page. The prefill worker
took those faults inside its steps, pushing a burst's pages into blocks the decode worker had
never used: 37-67 thousand minor faults per chat-64 burst, ~10% of its CPU time in the kernel
(benchmarks/HISTORY.md, session 29), until the whole cache had been written once. Anonymous
memory (torch.zeros) has no such cost: zero-filling it at allocation touches every page.

populate() asks the kernel to fault the whole mapping in, writable, without touching the data
(MADV_POPULATE_WRITE, Linux 5.14+); older kernels keep faulting lazily, as before.
"""
from __future__ import annotations

import ctypes
import mmap

import torch

MADV_POPULATE_WRITE = 23  # linux/mman.h


def populate(tensor: torch.Tensor) -> bool:
    """Fault in every page under a file-backed tensor's storage. False where the kernel cannot
    (then the pages fault in lazily, as they did before)."""
    start = tensor.untyped_storage().data_ptr()
    length = tensor.untyped_storage().nbytes()
    aligned = start - start % mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(aligned, length + (start - aligned), MADV_POPULATE_WRITE) == 0
