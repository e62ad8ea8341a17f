"""Guard for running the Triton kernels on CPU tensors, which only the interpreter can do."""
from __future__ import annotations

import torch
from triton.runtime import JITFunction


def ensure_runnable(kernel, device: torch.device) -> None:
    # The interpreter is chosen when a kernel is decorated, i.e. when its module is imported.
    if device.type == "cpu" and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "Triton kernels run on CPU tensors only in the interpreter: set TRITON_INTERPRET=1 "
            "before the first use of a kernels.*_triton function"
        )
