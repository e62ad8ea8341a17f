"""The batched LoRA kernels against the torch reference (kernels/lora_reference.py): the native
CPU kernels (kernels/csrc/cpu_lora.cpp) on decode and prefill shapes, and the Triton kernels
(kernels/triton_lora.py) on small shapes under TRITON_INTERPRET=1 (the conftest sets it).

Every case draws its own random inputs from a generator seeded by (case, seed), for several
seeds. The cases cover slot -1 rows, one slot for all tokens, a different slot per token, runs
of one slot (a prefill's shape), R and S at their limits, T = 0 and 1, y a column slice of a
wider output (the columns around it must stay untouched) and xa a column slice of a wider
float32 tensor.

Tolerances: float32 sums in another order differ by ~n * 2^-24 of the sum of the magnitudes
of their terms (`bound`, the same products on absolute values), allowed 1e-5 of it; a 16-bit y
may besides round to the neighbouring value, one unit of its dtype (eps * |y|).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from kvrelay.kernels import lora_ops, lora_reference, native_lora
from tests.kernels.native_support import on_one_thread_and_more, require_built

FLOAT32_SUMS = 1e-5  # of `bound`: float32 sums taken in another order
PAD_LEFT, PAD_RIGHT = 8, 24  # columns around y's slice, which must stay untouched


@dataclass(frozen=True)
class Case:
    tokens: int
    in_features: int
    out_features: int
    ranks: int
    num_slots: int
    slots: str  # "mixed" (with -1), "one", "distinct", "runs" or "none"

    def __str__(self) -> str:
        return (f"T{self.tokens}-in{self.in_features}-out{self.out_features}-R{self.ranks}"
                f"-S{self.num_slots}-{self.slots}")


@dataclass
class Inputs:
    x: torch.Tensor  # [T, in]
    a: torch.Tensor  # [S, R, in]
    b_t: torch.Tensor  # [S, R, out]
    token_slots: torch.Tensor  # [T] int32
    y_wide: torch.Tensor  # [T, PAD_LEFT + out + PAD_RIGHT]: y is its middle columns
    xa_wide: torch.Tensor  # [T, 3R] float32: xa is its middle R columns

    @property
    def y(self) -> torch.Tensor:
        return self.y_wide[:, PAD_LEFT:PAD_LEFT + self.b_t.shape[2]]

    @property
    def xa(self) -> torch.Tensor:
        ranks = self.a.shape[1]
        return self.xa_wide[:, ranks:2 * ranks]


def token_slots(case: Case, generator: torch.Generator) -> torch.Tensor:
    t, s = case.tokens, case.num_slots
    if case.slots == "mixed":
        slots = torch.randint(-1, s, (t,), generator=generator)
        # both kinds of row whatever the draw; T = 1 gets an adapter
        slots[:2] = torch.tensor([s - 1, -1])[:t]
    elif case.slots == "one":
        slots = torch.full((t,), s - 1)
    elif case.slots == "distinct":
        assert s >= t
        slots = torch.randperm(s, generator=generator)[:t]
    elif case.slots == "runs":  # runs of random lengths, some of them -1, as a prefill's sequences
        lengths = torch.randint(1, 12, (t,), generator=generator)
        run_slots = torch.randint(-1, s, (t,), generator=generator)
        slots = torch.repeat_interleave(run_slots, lengths)[:t]
    else:
        slots = torch.full((t,), -1)
    return slots.to(torch.int32)


def make_inputs(case: Case, dtype: torch.dtype, seed: int) -> Inputs:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case} {seed}".encode()))
    t, r = case.tokens, case.ranks

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return Inputs(
        x=randn(t, case.in_features).to(dtype),
        a=(randn(case.num_slots, r, case.in_features) / case.in_features ** 0.5).to(dtype),
        b_t=(randn(case.num_slots, r, case.out_features) / r ** 0.5).to(dtype),
        token_slots=token_slots(case, generator),
        y_wide=randn(t, PAD_LEFT + case.out_features + PAD_RIGHT).to(dtype),
        xa_wide=randn(t, 3 * r),
    )


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|got - want| within float32 reordering of `bound`, plus one unit of a 16-bit dtype."""
    rounding = 0.0 if want.dtype == torch.float32 else torch.finfo(want.dtype).eps
    error = (got.float() - want.float()).abs()
    allowed = rounding * want.float().abs() + FLOAT32_SUMS * bound
    worst = int((error - allowed).argmax()) if error.numel() else 0
    assert bool((error <= allowed).all()), (
        f"{what}: error {error.flatten()[worst]:.3g} above {allowed.flatten()[worst]:.3g} at flat "
        f"index {worst}")


def check_backend(shrink, expand_, case: Case, dtype: torch.dtype, seed: int) -> None:
    """shrink and expand_ (the lora_ops signatures) against the reference on one case."""
    inputs = make_inputs(case, dtype, seed)
    slots, no_adapter = inputs.token_slots, inputs.token_slots < 0
    where = f"{case} {dtype} seed {seed}"

    got = shrink(inputs.x, inputs.a, slots)
    assert got.shape == (case.tokens, case.ranks) and got.dtype == torch.float32, where
    want = lora_reference.lora_shrink(inputs.x, inputs.a, slots)
    bound = lora_reference.lora_shrink(inputs.x.abs(), inputs.a.abs(), slots)
    assert_close(got, want, bound, f"shrink {where}")
    assert bool((got[no_adapter] == 0).all()), f"shrink {where}: slot -1 rows not zero"

    before = inputs.y_wide.clone()
    expand_(inputs.y, inputs.xa, inputs.b_t, slots)
    want_wide = before.clone()
    want_y = want_wide[:, PAD_LEFT:PAD_LEFT + case.out_features]
    lora_reference.lora_expand_(want_y, inputs.xa, inputs.b_t, slots)
    bound = want_y.float().abs()
    lora_reference.lora_expand_(bound, inputs.xa.abs(), inputs.b_t.float().abs(), slots)
    assert_close(inputs.y, want_y, bound, f"expand {where}")
    assert torch.equal(inputs.y_wide[:, :PAD_LEFT], before[:, :PAD_LEFT]), where
    assert torch.equal(inputs.y_wide[:, PAD_LEFT + case.out_features:],
                       before[:, PAD_LEFT + case.out_features:]), where
    assert torch.equal(inputs.y_wide[no_adapter], before[no_adapter]), f"{where}: -1 rows written"


# ---- native CPU kernels -----------------------------------------------------------------------

NATIVE_CASES = [
    Case(1, 576, 960, 16, 4, "mixed"),  # a decode step of one token
    Case(64, 576, 960, 16, 4, "mixed"),  # a decode batch (enough work to use the threads)
    Case(37, 200, 150, 13, 3, "runs"),  # tails everywhere: in % 16, out % 64, R % 4
    Case(16, 64, 80, 1, 16, "distinct"),  # R = 1, every token its own slot of 16
    Case(33, 96, 128, 128, 1, "one"),  # R = 128, one slot for all
    Case(45, 48, 70, 64, 16, "runs"),
    Case(20, 32, 16, 8, 2, "none"),
    Case(0, 64, 64, 8, 2, "mixed"),
]
PREFILL = Case(2048, 576, 960, 16, 4, "runs")


@pytest.fixture(scope="module")
def native():
    """The built extension (native_support.require_built's rule)."""
    return require_built(native_lora.lora_ops(), "native LoRA kernels")


def native_backend(ops):
    return (lambda x, a, slots: native_lora.shrink(ops, x, a, slots),
            lambda y, xa, b_t, slots: native_lora.expand_(ops, y, xa, b_t, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", NATIVE_CASES, ids=str)
def test_native_matches_the_reference(native, case, dtype):
    for seed in range(3):
        check_backend(*native_backend(native), case, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_matches_the_reference(native, dtype):
    check_backend(*native_backend(native), PREFILL, dtype, seed=0)


def test_native_gives_the_same_bits_on_one_thread_and_more(native):
    inputs = make_inputs(PREFILL, torch.bfloat16, seed=1)

    def run():
        y = inputs.y_wide.clone()
        shrunk = native_lora.shrink(native, inputs.x, inputs.a, inputs.token_slots)
        native_lora.expand_(native, y[:, PAD_LEFT:-PAD_RIGHT], shrunk, inputs.b_t,
                            inputs.token_slots)
        return shrunk, y

    (shrunk_one, y_one), (shrunk_more, y_more) = on_one_thread_and_more(run)
    assert torch.equal(shrunk_one, shrunk_more) and torch.equal(y_one, y_more)


@pytest.mark.parametrize("bad_slot", [4, -2])
def test_native_and_reference_reject_a_slot_out_of_range(native, bad_slot):
    inputs = make_inputs(Case(6, 32, 32, 4, 4, "mixed"), torch.float32, seed=0)
    slots = inputs.token_slots.clone()
    slots[3] = bad_slot
    for shrink, _ in (native_backend(native), (lora_reference.lora_shrink, None)):
        with pytest.raises(ValueError, match="slot"):
            shrink(inputs.x, inputs.a, slots)
    before = inputs.y_wide.clone()
    for _, expand_ in (native_backend(native), (None, lora_reference.lora_expand_)):
        with pytest.raises(ValueError, match="slot"):
            expand_(inputs.y, inputs.xa, inputs.b_t, slots)
    assert torch.equal(inputs.y_wide, before)  # checked before any row is written


# ---- Triton kernels, interpreted ---------------------------------------------------------------

TRITON_CASES = [
    Case(1, 64, 80, 8, 2, "mixed"),
    Case(5, 40, 70, 13, 3, "runs"),
    Case(20, 48, 96, 16, 4, "runs"),  # with 16-token blocks: one-slot tiles and mixed blocks
    Case(16, 32, 48, 1, 16, "distinct"),  # R = 1; S = 16, each token its own slot
    Case(18, 32, 40, 64, 1, "one"),  # R = 64 (one rank block), S = 1: tiles only
    Case(12, 32, 24, 8, 2, "none"),
    Case(0, 32, 32, 8, 2, "mixed"),
]


@pytest.mark.parametrize("block_tokens", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_matches_the_reference(case, dtype, block_tokens):
    from kvrelay.kernels import triton_lora

    def shrink(x, a, slots):
        return triton_lora.shrink(x, a, slots, block_tokens=block_tokens)

    def expand_(y, xa, b_t, slots):
        triton_lora.expand_(y, xa, b_t, slots, block_tokens=block_tokens)

    for seed in range(2):
        check_backend(shrink, expand_, case, dtype, seed)


# ---- the dispatcher --------------------------------------------------------------------------


@pytest.mark.parametrize("native_built", [True, False])
def test_dispatch_on_cpu_matches_the_reference(monkeypatch, native_built):
    if not native_built:  # the reference stands in where the extension cannot be built
        monkeypatch.setattr(native_lora, "lora_ops", lambda: None)
    check_backend(lora_ops.lora_shrink, lora_ops.lora_expand_, Case(9, 64, 96, 8, 3, "mixed"),
                  torch.bfloat16, seed=0)


def _bad_calls(inputs: Inputs):
    x, a, b_t, slots, y, xa = (inputs.x, inputs.a, inputs.b_t, inputs.token_slots, inputs.y,
                               inputs.xa)
    yield "must share one of", lambda: lora_ops.lora_shrink(x, a.float(), slots)
    yield "must share one of", lambda: lora_ops.lora_shrink(x.to(torch.int8), a.to(torch.int8),
                                                            slots)
    yield r"\[S, R, in\]", lambda: lora_ops.lora_shrink(x, a[:, :, 1:], slots)
    yield "token_slots", lambda: lora_ops.lora_shrink(x, a, slots.long())
    yield "token_slots", lambda: lora_ops.lora_shrink(x, a, slots[1:])
    yield "unit column stride", lambda: lora_ops.lora_shrink(x.T.contiguous().T, a, slots)
    yield "contiguous", lambda: lora_ops.lora_expand_(y, xa, b_t.transpose(0, 1).contiguous()
                                                      .transpose(0, 1), slots)
    yield "xa", lambda: lora_ops.lora_expand_(y, xa.to(y.dtype), b_t, slots)
    yield "xa", lambda: lora_ops.lora_expand_(y, inputs.xa_wide, b_t, slots)
    yield r"\[S, R, out\]", lambda: lora_ops.lora_expand_(y[:, 1:], xa, b_t, slots)


@pytest.mark.parametrize("native_built", [True, False])
def test_dispatch_rejects_bad_operands_with_clear_messages(monkeypatch, native_built):
    if not native_built:  # the Python checks, which the Triton path shares
        monkeypatch.setattr(native_lora, "lora_ops", lambda: None)
    inputs = make_inputs(Case(6, 32, 40, 4, 3, "mixed"), torch.bfloat16, seed=0)
    for message, call in _bad_calls(inputs):
        with pytest.raises(ValueError, match=message):
            call()


def test_dispatch_of_no_tokens():
    x, a = torch.empty(0, 64, dtype=torch.bfloat16), torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    slots = torch.empty(0, dtype=torch.int32)
    out = lora_ops.lora_shrink(x, a, slots)
    assert out.shape == (0, 8) and out.dtype == torch.float32
    lora_ops.lora_expand_(torch.empty(0, 32, dtype=torch.bfloat16), out,
                          torch.zeros(2, 8, 32, dtype=torch.bfloat16), slots)
