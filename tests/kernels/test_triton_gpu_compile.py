import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).parents[2]


def test_triton_kernels_compile_for_hopper():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_for_gpu"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled" in result.stdout
