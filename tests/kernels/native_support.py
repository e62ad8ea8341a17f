"""The native CPU decode kernel for tests: skipped only where no C++ compiler exists at all;
with one, a build failure fails the tests instead of hiding behind the torch fallback."""
import os
import shutil

import pytest
import torch

from kvrelay.kernels import native_cpu


def require_native_decode():
    return require_built(native_cpu.paged_decode_op(), "native CPU decode kernel")


def require_built(ops, what: str):
    """A native extension, or a skip where no C++ compiler exists at all; with one, a build
    failure fails the test instead of hiding behind a torch fallback."""
    if ops is None:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip(f"no C++ compiler: the {what} cannot be built here")
        pytest.fail(f"a C++ compiler exists but the {what} did not build or load")
    return ops


def on_one_thread_and_more(run):
    """run() on one torch thread, then on at least two: both outputs (the thread count is
    restored)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
        torch.set_num_threads(max(2, threads))
        return single, run()
    finally:
        torch.set_num_threads(threads)
