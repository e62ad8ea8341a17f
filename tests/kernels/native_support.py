"""The native CPU decode kernel for tests: skipped only where no C++ compiler exists at all;
with one, a build failure fails the tests instead of hiding behind the torch fallback."""
import os
import shutil

import pytest

from kernels import native_cpu


def require_native_decode():
    op = native_cpu.paged_decode_op()
    if op is None:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler: the native CPU decode kernel cannot be built here")
        pytest.fail("a C++ compiler exists but the native CPU decode kernel did not build or load")
    return op
