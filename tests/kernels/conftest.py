import os

# Must be set before the Triton kernels are decorated, so they run in the CPU interpreter.
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402  (after the variable above)

from kvrelay.kernels import native_elementwise  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    """The fused CPU elementwise ops (kernels/csrc/cpu_elementwise.cpp), built once."""
    built = native_elementwise.elementwise_ops()
    if built is None:
        pytest.skip("no C++ toolchain to build the native ops")
    return built
