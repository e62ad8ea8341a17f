"""Build a model's modules without initializing their weights: they are loaded (or randomized)
right after, and on the meta device torch's `normal_` runs through its reference
implementation, which imports torch._dynamo and with it triton, whose bindings then print
pages of "nanobind: leaked ..." when the process exits."""
from __future__ import annotations

import contextlib

import torch

_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "trunc_normal_", "zeros_", "ones_",
                   "constant_")


def _keep(tensor, *args, **kwargs):
    return tensor


@contextlib.contextmanager
def skip_weight_init():
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)
