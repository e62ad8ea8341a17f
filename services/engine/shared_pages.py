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

reserve() creates the file with its pages allocated (posix_fallocate). A sparse file claimed no
room up front, so a tmpfs too small for the cache (a container's default 64 MB /dev/shm) let the
worker start and then killed it with SIGBUS at the first write to a page it could not back;
now the worker stops at start-up and says how much room it needs.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

import torch

MADV_POPULATE_WRITE = 23  # linux/mman.h
MIB, GIB = 1 << 20, 1 << 30


class CacheSpaceError(OSError):
    """The shared KV cache does not fit in the free room of its directory's filesystem."""


def reserve(path: str, num_bytes: int) -> None:
    """Create `path` as a file of `num_bytes` whose pages exist now (zeros), or raise
    CacheSpaceError, leaving no file, where its filesystem has less room than that."""
    with open(path, "wb") as handle:
        try:
            os.posix_fallocate(handle.fileno(), 0, num_bytes)
            return
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise
    os.unlink(path)  # frees the pages it did get
    directory = os.path.dirname(path) or "."
    raise CacheSpaceError(
        errno.ENOSPC,
        f"the shared KV cache needs {_size(num_bytes)} in {directory}, which has "
        f"{_size(_free_bytes(directory))} free: give that filesystem more room (docker run "
        f"--shm-size, or a Kubernetes emptyDir with medium Memory and a sizeLimit), point "
        f"--shm-dir at a larger tmpfs, lower --kv-cache-memory / --num-kv-blocks, or drop shm "
        f"from --kv-transports (KV pages then travel over gRPC)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def _free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def populate(tensor: torch.Tensor) -> bool:
    """Fault in every page under a file-backed tensor's storage. False where the kernel cannot
    (then the pages fault in lazily, as they did before)."""
    start = tensor.untyped_storage().data_ptr()
    length = tensor.untyped_storage().nbytes()
    aligned = start - start % mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(aligned, length + (start - aligned), MADV_POPULATE_WRITE) == 0
