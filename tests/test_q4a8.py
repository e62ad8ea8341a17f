"""The VNNI kernel over the checkpoint's 4-bit blocks (kernels/native_q4a8.py): against its torch
reference on fresh random inputs, for both codings of the activations; each coding's error
against the exact float32 product; rows that do not depend on the batch; refusals."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from kvrelay.kernels import native_q4a8

pytestmark = pytest.mark.skipif(native_q4a8.q4a8_ops() is None,
                                reason="no AVX512-VNNI on this CPU, or no compiler")

SHAPES = [(1536, 576), (576, 1536), (192, 576)]  # the default model's [N, K] kinds


def random_blocks(rng, n: int, k: int):
    """q [N, K] in 0..15 and float16-exact scale and zero, as GGUF's Q4_1 blocks hold."""
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-rng.random((n, k // 32)) * 0.1).astype(np.float16).astype(np.float32)
    return q, d, m + 8 * d


def dequantized(q, scale, zero) -> torch.Tensor:  # [N, K] float32
    n, k = q.shape
    codes = torch.from_numpy(q.astype(np.float32)).view(n, k // 32, 32)
    return ((codes - 8) * torch.from_numpy(scale)[..., None]
            + torch.from_numpy(zero)[..., None]).view(n, k)


def activations(rows: int, k: int) -> torch.Tensor:
    """Heavy-tailed like a layer's inputs: a few large values among small ones."""
    x = torch.randn(rows, k) * torch.exp(torch.randn(rows, k))
    x[:, 0] = 0.0  # a zero ...
    if rows > 1:
        x[1, :32] = 0.0  # ... and a block of zeros (step 0)
    return x.bfloat16()


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_kernel_computes_its_reference(n, k, split):
    rng = np.random.default_rng()
    q, scale, zero = random_blocks(rng, n, k)
    tiles = native_q4a8.pack(q, scale, zero)
    for rows in (1, 3, 8, 9, 70, 131):  # passes of 8 rows, row blocks of 64
        x = activations(rows, k)
        got = native_q4a8.matmul(native_q4a8.q4a8_ops(), x, tiles, split).float()
        want = native_q4a8.reference(x, q, scale, zero, split)
        # the output is rounded to bf16 (half an ulp: 2^-8 of the value), after float32 sums
        # in another order than the reference's: within one ulp
        bound = 2 ** -7 * want.abs() + 1e-4 * want.abs().max()
        assert ((got - want).abs() <= bound).all(), (rows, (got - want).abs().max())


@pytest.mark.parametrize("split,bound", [(True, 2 ** -12), (False, 2 ** -5)])
def test_each_coding_bounds_the_error_against_the_exact_product(split, bound):
    """Split codes ~15 bits per 32 activations: finer than bf16's rounding of the output;
    int8 ~7 bits against the block's largest value."""
    rng = np.random.default_rng()
    q, scale, zero = random_blocks(rng, 576, 1536)
    x = activations(16, 1536)
    exact = x.float() @ dequantized(q, scale, zero).T
    coded = native_q4a8.reference(x, q, scale, zero, split)
    assert (coded - exact).abs().max() <= bound * exact.abs().max()


@pytest.mark.parametrize("split", [True, False])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(split):
    rng = np.random.default_rng()
    q, scale, zero = random_blocks(rng, 1536, 576)
    tiles = native_q4a8.pack(q, scale, zero)
    ops = native_q4a8.q4a8_ops()
    batch = activations(77, 576)
    together = native_q4a8.matmul(ops, batch, tiles, split)
    for row in (0, 7, 8, 63, 64, 76):
        alone = native_q4a8.matmul(ops, batch[row:row + 1], tiles, split)
        assert torch.equal(alone[0], together[row]), row


def test_bad_shapes_are_refused():
    rng = np.random.default_rng()
    q, scale, zero = random_blocks(rng, 48, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        native_q4a8.pack(q[:40], scale[:40], zero[:40])
    with pytest.raises(ValueError, match="float16"):
        native_q4a8.pack(q, scale * (1 + 1e-6), zero)
    tiles = native_q4a8.pack(q, scale, zero)
    with pytest.raises(RuntimeError, match="does not match"):
        native_q4a8.matmul(native_q4a8.q4a8_ops(), torch.zeros(2, 96).bfloat16(), tiles)
    with pytest.raises(RuntimeError, match="bf16"):
        native_q4a8.matmul(native_q4a8.q4a8_ops(), torch.zeros(2, 64), tiles)


@pytest.mark.parametrize("argv,coding", [([], "split"), (["--int8-activations"], "int8"),
                                         (["--q4a8-max-tokens", "0"], None)])
def test_the_worker_flags_choose_the_coding(argv, coding):
    """A worker's own flags, parsed as `kvrelay worker` parses them, reach its model runner."""
    from kvrelay.worker import main as worker_main
    from kvrelay.worker.model_setup import load_worker_model

    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    args = parser.parse_args(["--dtype", "bfloat16", "--num-kv-blocks", "16", *argv])
    runner = load_worker_model(args, None).runner
    assert runner.q4a8 == coding
    assert runner.int4_kernel == ("q4a8" if coding == "int8" else "native")
