"""The native decode stack (every layer of a small decode step in one call,
services/engine/models/decode_stack.py) computes what the layer-by-layer path computes, bit for
bit: the logits and the K/V it stores, for plain decode rows and a speculative step's drafts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrelay.common import env_switches
from kvrelay.kernels import native_stack
from kvrelay.engine import LLM, SamplingParams

_BASE = [[1, 504, 3458, 282, 4649, 314, 29, 7, 2085, 1790, 28, 957, 253, 1928] * 3,
         [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173] * 7,
         [1, 504, 3458, 282] * 11]
# seventeen sequences, so that a step of 1 + 3 drafts each reaches past AMX's 64 rows
PROMPTS = _BASE + [_BASE[index % 3][:-index] for index in range(1, 15)]
BLOCKS_PER_SEQUENCE = 20


@pytest.fixture(scope="module")
def runner():
    runner = LLM(dtype="bfloat16", num_kv_blocks=BLOCKS_PER_SEQUENCE * len(PROMPTS)).engine.runner
    if not runner.decode_stack:
        pytest.skip("no native decode stack here (needs AVX512-BF16 and a compiler)")
    blocks = {}
    for index, prompt in enumerate(PROMPTS):  # prefill each prompt on blocks of its own
        first = BLOCKS_PER_SEQUENCE * index
        blocks[index] = list(range(first, first + BLOCKS_PER_SEQUENCE))
        _run(runner, [_item(prompt, 0, len(prompt), blocks[index], [])])
    runner.test_blocks = blocks
    return runner


def _item(tokens: list[int], start: int, num_new: int, block_ids: list[int],
          drafts: list[int]) -> SimpleNamespace:
    request = SimpleNamespace(num_computed_tokens=start, all_token_ids=tokens,
                              params=SamplingParams(), adapter_id=0)
    return SimpleNamespace(request=request, num_new_tokens=num_new, block_ids=[block_ids],
                           draft_token_ids=drafts, samples=True)


def _run(runner, items) -> torch.Tensor:
    return runner.execute(runner.prepare(items))


def _decode_items(runner, shape: list[int]) -> list[SimpleNamespace]:
    """One item per sequence: shape[i] query tokens (1 + drafts) for prompt i."""
    items = []
    for index, num_new in enumerate(shape):
        prompt = PROMPTS[index] + [2085]
        drafts = [957, 253, 1928][:num_new - 1]
        items.append(_item(prompt, len(PROMPTS[index]), num_new, runner.test_blocks[index],
                           drafts))
    return items


def _both_ways(runner, items):
    """(logits, KV cache) with the stack and then layer by layer, from the same cache."""
    model, before = runner.model, runner.kv_cache.clone()
    calls = []
    stack = model.decode_stack
    original = stack.run
    stack.run = lambda *args: calls.append(1) or original(*args)
    try:
        native = _run(runner, items), runner.kv_cache.clone()
    finally:
        stack.run = original
    runner.kv_cache.copy_(before)
    model.decode_stack = None
    try:
        layered = _run(runner, items), runner.kv_cache.clone()
    finally:
        model.decode_stack = stack
    return native, layered, len(calls)


@pytest.mark.parametrize("shape", [[1], [1, 1, 1], [3], [2, 1, 1], [1, 2], [3, 2], [4, 4],
                                   [4, 4, 1], [4, 1, 4, 3, 2, 4], [4] * 8, [4] * 10 + [3], [4] * 16],
                         ids=["one-row", "three-seqs", "token-and-two-drafts", "mixed", "two",
                              "five-rows", "eight-rows", "nine-rows", "eighteen-rows",
                              "thirty-two-rows", "forty-three-rows", "sixty-four-rows"])
def test_the_stack_equals_the_layers_bit_for_bit(runner, shape):
    # where this CPU has VNNI: one row on the gemv kernel, 2-11 on the VNNI one; else 1-4 on
    # gemv; where it has AMX, the steps above on AMX tiles up to amx_max_tokens (64)
    (native, native_kv), (layered, layered_kv), calls = _both_ways(runner, _decode_items(runner,
                                                                                        shape))
    assert calls == (1 if sum(shape) <= runner.model.decode_stack.max_rows else 0)
    assert native.shape == (sum(shape), runner.model.config.vocab_size)
    assert torch.equal(native, layered)
    assert torch.equal(native_kv, layered_kv)
    assert not torch.equal(native_kv, torch.zeros_like(native_kv))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8_bit_caches_take_the_stack_with_the_layers_outputs(kv_cache_dtype):
    """The stack stores and reads 8-bit rows with the same native ops as the layer path."""
    coded = LLM(dtype="bfloat16", num_kv_blocks=BLOCKS_PER_SEQUENCE * 4,
                kv_cache_dtype=kv_cache_dtype).engine.runner
    if not coded.decode_stack:
        pytest.skip("no native decode stack here (needs AVX512-BF16 and a compiler)")
    coded.test_blocks = {index: list(range(BLOCKS_PER_SEQUENCE * index,
                                           BLOCKS_PER_SEQUENCE * (index + 1)))
                         for index in range(4)}
    for index in range(4):
        _run(coded, [_item(PROMPTS[index], 0, len(PROMPTS[index]), coded.test_blocks[index], [])])
    for shape in ([1], [1, 1, 1], [2, 1, 1, 3]):
        (native, native_kv), (layered, layered_kv), calls = _both_ways(
            coded, _decode_items(coded, shape))
        assert calls == 1
        assert torch.equal(native, layered)
        assert torch.equal(native_kv.view(torch.uint8), layered_kv.view(torch.uint8))


def test_the_vnni_kernel_takes_two_to_eleven_rows_where_it_is(runner):
    stack = runner.model.decode_stack
    vnni = runner.q4a8 == "split"
    amx = runner.uses_amx and native_stack.stack_ops().DecodeStack.has_amx
    assert stack.max_rows == (runner.amx_max_tokens if amx else 11 if vnni else 4)
    assert stack.native.takes_rows(11) == (vnni or amx)
    assert stack.native.takes_rows(runner.amx_max_tokens) == amx
    assert not stack.native.takes_rows(runner.amx_max_tokens + 1)
    qkv = runner.model.layers[0].self_attn.qkv_proj
    rows = [max_rows for max_rows, _ in qkv.small_steps]  # AMX's 32 may follow where it runs
    assert rows[:2] == [1, 11] if vnni else rows[0] == 4


def test_the_heads_8_bit_blocks_take_the_steps_below_amxs(runner):
    # Above one gemv pass (3 rows) the AMX kernel's bf16 head beats the 8-bit blocks
    # (small_steps._head_gemv_rows).
    head_rows = [max_rows for max_rows, _ in runner.model.packed_head.small_steps]
    if runner.q8_head and runner.uses_amx:
        assert head_rows == [min(3, runner.int4_max_tokens), runner.amx_max_tokens]
    elif runner.q8_head:
        assert head_rows[0] == runner.int4_max_tokens


def test_a_short_prefill_chunk_is_decode_rows_too(runner):
    # cpu_plan plans a sequence of a few query tokens as decode rows, each seeing its own prefix
    prompt = PROMPTS[0] + [2085, 957]
    chunk = [_item(prompt, len(PROMPTS[0]) - 1, 3, runner.test_blocks[0], [])]
    (native, native_kv), (layered, layered_kv), calls = _both_ways(runner, chunk)
    assert calls == 1
    assert torch.equal(native, layered) and torch.equal(native_kv, layered_kv)


def test_steps_beyond_its_rows_run_layer_by_layer(runner):
    too_many = _decode_items(runner, [4] * 17)  # 68 rows: oneDNN's, in the Python path
    assert sum(item.num_new_tokens for item in too_many) > runner.model.decode_stack.max_rows
    _, _, calls = _both_ways(runner, too_many)
    assert calls == 0


def test_bad_tensors_get_a_clear_error(runner):
    stack = runner.model.decode_stack.native
    hidden = runner.model.config.hidden_size
    caches = [k for k, _ in runner.kv_caches]
    layers = len(caches)
    ids = torch.zeros(1, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int32)
    tables = [torch.zeros(1, 1, dtype=torch.int32)] * layers
    ropes = [torch.zeros(1, 1, 64, dtype=torch.bfloat16)] * layers
    residual = torch.zeros(1, hidden, dtype=torch.bfloat16)

    def run(residual=residual, caches=caches, slots=ids, token_ids=ids, ropes=ropes):
        stack.run(residual, ropes, ropes, caches, caches, [slots] * layers, token_ids, lens,
                  tables)
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        run(residual=torch.zeros(1, hidden))
    with pytest.raises(RuntimeError, match="one K and V cache, rope table"):
        run(caches=caches[:1])
    with pytest.raises(RuntimeError, match="cos, sin must be"):
        run(ropes=[torch.zeros(1, 1, 32, dtype=torch.bfloat16)] * layers)
    before = runner.kv_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):  # a row outside the batch
        run(token_ids=ids + 5)
    with pytest.raises(RuntimeError, match="lies outside the cache"):
        run(slots=ids + 10**9)
    assert torch.equal(runner.kv_cache, before)  # refused before anything was stored


def test_layer_callbacks_run_once_each_in_order_after_the_stack(runner):
    items = _decode_items(runner, [1, 1])
    done = []
    logits = runner.execute(runner.prepare(items), on_layer_done=done.append)
    assert done == list(range(len(runner.model.layers)))
    assert torch.equal(logits, _run(runner, items))


def test_the_switch_turns_the_stack_off(monkeypatch):
    monkeypatch.setenv(env_switches.NATIVE_DECODE_STACK.name, "0")
    native_stack.stack_ops.cache_clear()
    try:
        assert native_stack.stack_ops() is None
        runner = LLM(dtype="bfloat16", num_kv_blocks=16).engine.runner
        assert not runner.decode_stack and runner.model.decode_stack is None
    finally:
        native_stack.stack_ops.cache_clear()
