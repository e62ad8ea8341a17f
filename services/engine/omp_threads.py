"""One thread per process runs torch's parallel (OpenMP) work; others run their torch ops inline.

libgomp gives every thread that starts a parallel region a pool of its own and counts all of
their threads together. Once that count exceeds the CPUs, it throttles every pool: threads that
wait at a barrier spin about 100 times instead of about 300,000 and then sleep in the kernel,
so each of a forward pass's hundreds of parallel regions waits for futex wake-ups. Measured
here (benchmarks/HISTORY.md, 2026-11-29; the script is at commit fdc9dff): a 64-sequence
decode step took 77.7 ms while one thread had run torch ops, and 116.3 ms once a second
thread had.

A worker runs its forward passes on one compute thread; its event loop also copies KV pages
(sends and receives). `run_torch_ops_inline` makes the loop's torch ops single-threaded, so no
second pool is ever made.
"""
from __future__ import annotations

import ctypes
import functools

import torch

OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")


def run_torch_ops_inline() -> bool:
    """Make the calling thread's torch CPU ops run on this thread alone, without starting an
    OpenMP team. Other threads keep their thread count. False if no OpenMP runtime is loaded
    (torch then has no thread pools to throttle)."""
    runtimes = _openmp_runtimes()
    # ATen sets a thread's OpenMP thread count on the thread's first parallel op; doing that now
    # means it is not done again after the count is lowered below.
    torch.get_num_threads()
    # Each runtime keeps its own per-thread count; setting it in all of them reaches the one
    # torch links whatever else (numpy's, a system libgomp) the process has loaded.
    for runtime in runtimes:
        runtime.omp_set_num_threads(1)
    return bool(runtimes)


@functools.cache
def _openmp_runtimes() -> tuple[ctypes.CDLL, ...]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return ()
    names = sorted(path for path in paths
                   if path.rsplit("/", 1)[-1].startswith(OPENMP_LIBRARIES))
    return tuple(ctypes.CDLL(path) for path in names)
