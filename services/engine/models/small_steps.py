"""Which kernel multiplies the matmuls of a step of few tokens (bf16 on CPU).

Decode steps are bound by reading the weights, and oneDNN's bf16 GEMM reads them slowest at
few rows (BENCHMARKS.md). Steps of up to `int4_max_tokens` tokens multiply the checkpoint's own
blocks: the native AVX512-BF16 kernel (kernels/native_gemv.py) where it builds, the head too
(its 8-bit blocks where the checkpoint has them, models/gguf_q8_head.py, up to 3 rows where AMX
takes the steps above; else bf16 tiles); else
torch's int4 kernel (layers only). Steps of up to `amx_max_tokens` run on AMX tiles
(kernels/native_amx.py). The native kernels share one copy of each layer weight, the 4-bit
tiles. Larger steps stay on oneDNN.

Where the CPU has AVX512-VNNI, the VNNI kernel (kernels/native_q4a8.py: integer dot products,
twice the multiply-adds per instruction of bf16 ones) takes the layers' steps of 2 up to
`q4a8_max_tokens` tokens, its activations coded twice per 32 values (finer than bf16); AMX, where
it runs, the steps above those (on an AMX Xeon a 4-row step took 16.3 ms with the gemv kernel and
12.6 with VNNI, an 8-row one 21.9 on AMX tiles and 19.9 with VNNI; HISTORY, session 23; since
the VNNI kernel's rows were unrolled, the layers of 9-11-row steps too: 8.9-10.3 against
10.3-11.7 ms at 9 rows, 9.9-12.3 against 10.6-12.9 at 11; HISTORY, session 26). With
`int8_activations` it takes every layer step, prefill included, its activations coded once
(llama.cpp's Q8: faster, coarser). The head keeps its kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kvrelay.common.env_switches import Q8_HEAD
from kvrelay.kernels import native_amx, native_gemv, native_q4a8, native_stack
from kvrelay.engine.models import gguf_int4
from kvrelay.engine.models.decode_stack import DecodeStack
from kvrelay.engine.models.gguf_q8_head import Q8Blocks
from kvrelay.engine.models.layers.moe import SparseMoE
from kvrelay.kernels.moe_weights import ExpertWeights
from kvrelay.engine.models.packed_linear import EVERY_STEP

Q8_HEAD_MAX_ROWS_BESIDE_AMX = 3  # the head's 8-bit gemv steps where AMX takes the larger ones


@dataclass(frozen=True, slots=True)
class SmallStepKernels:
    """What was attached: the kernel of the smallest steps ("native", "torch", "q4a8" or None),
    whether AMX runs the next ones, and how the VNNI kernel codes activations where it runs
    ("split", "int8" or None)."""
    int4_kernel: str | None
    amx: bool
    q8_head: bool = False  # the head's small steps on its 8-bit blocks
    q4a8: str | None = None
    decode_stack: bool = False  # the smallest decode steps' layers in one native call
    bf16_gemv: bool = False  # the layers' smallest steps on bf16 tiles (no 4-bit blocks)


def attach(model, q4_blocks: dict, int4_max_tokens: int, amx_max_tokens: int,
           q8_head: Q8Blocks | None = None, q4a8_max_tokens: int = 0,
           int8_activations: bool = False, bf16_tiles: dict | None = None) -> SmallStepKernels:
    """q4_blocks: parameter name -> gguf_int4.Q4Blocks (empty where the source has none);
    q8_head: the checkpoint's 8-bit head (gguf_q8_head.py), or None; bf16_tiles: parameter
    name -> the layer weight's bf16 tiles (bf16_layer_tiles), where there are no 4-bit blocks."""
    if not _native_kernels_take(q4_blocks):
        return _attach_torch_int4(model, q4_blocks, int4_max_tokens)
    gemv = native_gemv.gemv_ops() if int4_max_tokens else None
    amx = native_amx.amx_ops() if amx_max_tokens > int4_max_tokens else None
    # like AMX, the kernel takes the steps above the gemv kernel's (every step with int8)
    wanted = int8_activations or q4a8_max_tokens > int4_max_tokens
    q4a8, q4a8_tiles = _attach_q4a8(model, q4_blocks, q4a8_max_tokens, int8_activations) \
        if wanted else (None, {})
    every_step = q4a8 == "int8"  # then no other kernel multiplies the layers
    tiles = _q4_tiles(q4_blocks) if (gemv or amx) and not every_step else {}
    head_fits = model.packed_head is not None and native_amx.shape_supported(
        model.packed_head.out_features, model.config.hidden_size)
    q8_tiles = None
    if gemv is not None and head_fits and q8_head is not None and \
            Q8_HEAD.enabled():
        q8_tiles = native_gemv.pack_q8(q8_head.q, q8_head.d)
    head = None
    if head_fits and (amx is not None or (gemv is not None and q8_tiles is None)):
        head = native_amx.pack_bf16(model.head_weight)
    int4_kernel = "q4a8" if every_step else None
    if gemv is not None:
        layer_rows = _layer_gemv_rows(int4_max_tokens, tiles, q4a8, q4a8_tiles)
        model.add_small_step_kernels_(
            layer_rows,
            {name: _bound(native_gemv, "matmul_q4", gemv, t) for name, t in tiles.items()}, None)
        model.add_small_step_kernels_(_head_gemv_rows(int4_max_tokens, q8_tiles, amx),
                                      {}, _gemv_head(gemv, q8_tiles, head))
        int4_kernel = "native" if tiles else int4_kernel
        vnni = (q4a8_tiles, q4a8_max_tokens) if q4a8 == "split" else ({}, 0)
        bf16_tiles = {} if tiles or q4_blocks else (bf16_tiles or {})
        _attach_bf16(model, gemv, int4_max_tokens, bf16_tiles)
        model.decode_stack = _decode_stack(model, tiles, layer_rows, *vnni,
                                           amx_max_tokens if amx is not None else 0, bf16_tiles)
    elif q4_blocks and int4_max_tokens and not every_step and gguf_int4.int4_supported():
        model.add_small_step_kernels_(
            int4_max_tokens, {name: blocks.to_torch().matmul for name, blocks in q4_blocks.items()},
            None)
        int4_kernel = "torch"
    if amx is not None:
        model.add_small_step_kernels_(
            amx_max_tokens,
            {name: _bound(native_amx, "matmul_q4", amx, t) for name, t in tiles.items()},
            None if head is None else _bound(native_amx, "matmul_bf16", amx, head))
    return SmallStepKernels(int4_kernel, amx is not None, q8_tiles is not None, q4a8,
                            model.decode_stack is not None,
                            bool(bf16_tiles) and gemv is not None and not tiles and not q4_blocks)


def _native_kernels_take(q4_blocks: dict) -> bool:
    """Whether the native kernels' tiles can hold every block: inputs in order (not GPTQ's
    act-order) and scale and zero - 8 * scale float16 values (every GGUF's Q4_0/Q4_1; GPTQ's
    symmetric zero points; not most AWQ and GPTQ zero points, which are 4-bit integers times
    the scale)."""
    for blocks in q4_blocks.values():
        if blocks.input_order is not None:
            return False
        try:
            native_amx.q4_scales_as_float16(blocks.scale, blocks.zero)
        except ValueError:
            return False
    return True


def _attach_torch_int4(model, q4_blocks: dict, int4_max_tokens: int) -> SmallStepKernels:
    """Blocks the native kernels cannot hold: every layer's small steps on torch's int4 kernel
    (which takes any scale and zero, in bf16), gathering x's columns first where the blocks
    hold their inputs reordered."""
    if not (int4_max_tokens and gguf_int4.int4_supported()):
        return SmallStepKernels(None, False)
    model.add_small_step_kernels_(
        int4_max_tokens, {name: blocks.to_torch().matmul for name, blocks in q4_blocks.items()},
        None)
    return SmallStepKernels("torch", False)


def bf16_layer_tiles(model) -> dict:
    """Where the gemv kernel builds: every layer matmul weight of a bf16 model in the kernel's
    bf16 tiles, by parameter name (an experts module's name: a list of (w13, w2) tiles per
    expert; the routers stay float32); else {}. Taken before the weights are packed for
    oneDNN: it is a second copy of them."""
    if native_gemv.gemv_ops() is None:
        return {}
    tiles = {}
    for parent_name, parent in model.layers.named_modules():
        if isinstance(parent, SparseMoE):
            experts = parent.experts
            if native_amx.shape_supported(*experts.w13.shape[1:]) and \
                    native_amx.shape_supported(*experts.w2.shape[1:]):
                tiles[f"layers.{parent_name}.experts"] = [
                    (native_amx.pack_bf16(experts.w13[e]), native_amx.pack_bf16(experts.w2[e]))
                    for e in range(experts.num_experts)]
            continue
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear) and native_amx.shape_supported(*child.weight.shape):
                tiles[f"layers.{parent_name}.{child_name}"] = native_amx.pack_bf16(child.weight)
    return tiles


def _attach_bf16(model, gemv, max_rows: int, bf16_tiles: dict) -> None:
    """The layers' steps of up to max_rows tokens on the gemv kernel's bf16 tiles (experts
    too)."""
    experts = {name: module for name, module in model.named_modules()
               if isinstance(module, ExpertWeights)}
    matmuls = {}
    for name, tiles in bf16_tiles.items():
        if name in experts:
            experts[name].add_small_step_kernels_(
                max_rows, [_bound(native_gemv, "matmul_bf16", gemv, w13) for w13, _ in tiles],
                [_bound(native_gemv, "matmul_bf16", gemv, w2) for _, w2 in tiles])
        else:
            matmuls[name] = _bound(native_gemv, "matmul_bf16", gemv, tiles)
    model.add_small_step_kernels_(max_rows, matmuls, None)


def _layer_gemv_rows(int4_max_tokens: int, tiles: dict, q4a8: str | None,
                     q4a8_tiles: dict) -> int:
    """How many rows the layers' matmuls take on the gemv kernel. Where the VNNI kernel runs
    every layer matmul with split coding, it takes them from two rows: it was as fast at one
    row and faster from two (a decode step of 2 / 3 / 4 rows 4.1-4.4 -> 3.7, 5.3-5.4 -> 4.7,
    7.5-7.6 -> 6.1-6.5 ms; HISTORY, session 22), and its activations are coded finer than
    bf16. The head keeps int4_max_tokens."""
    if q4a8 == "split" and tiles and set(tiles) <= set(q4a8_tiles):
        return min(1, int4_max_tokens)
    return int4_max_tokens


def _decode_stack(model, tiles: dict, gemv_max_rows: int, vnni_tiles: dict,
                  vnni_max_rows: int, amx_max_rows: int,
                  bf16_tiles: dict) -> DecodeStack | None:
    """The layers of small decode steps in one native call, where the model and this machine
    allow it (decode_stack.py): the gemv kernel's steps, the VNNI kernel's above them where it
    runs every layer matmul and the build has it, and AMX's above those where the build has it
    (the Python path's amx_max_tokens)."""
    if not tiles:  # a bf16 checkpoint: its tiles, on the gemv kernel's steps only
        ops = native_stack.stack_ops() if bf16_tiles else None
        if ops is None or not DecodeStack.fits(model, bf16_tiles):
            return None
        return DecodeStack(ops, model, {}, gemv_max_rows, bf16_tiles=bf16_tiles)
    ops = native_stack.stack_ops()
    if ops is None or not DecodeStack.fits(model, tiles):
        return None
    if not ops.DecodeStack.has_vnni or not DecodeStack.fits(model, vnni_tiles):
        vnni_tiles, vnni_max_rows = {}, 0
    if not ops.DecodeStack.has_amx:
        amx_max_rows = 0
    return DecodeStack(ops, model, tiles, gemv_max_rows, vnni_tiles, vnni_max_rows, amx_max_rows)


def _attach_q4a8(model, q4_blocks: dict, max_tokens: int,
                 int8_activations: bool) -> tuple[str | None, dict]:
    """The layers' steps of up to max_tokens (every step with int8_activations) on the VNNI
    kernel; its coding of the activations ("split" or "int8", None where it does not run) and
    its tiles by parameter name."""
    ops = native_q4a8.q4a8_ops() if q4_blocks else None
    tiles = {} if ops is None else _q4a8_tiles(q4_blocks)
    if not tiles:
        return None, {}
    split = not int8_activations
    model.add_small_step_kernels_(
        max_tokens if split else EVERY_STEP,
        {name: _q4a8_matmul(ops, t, split) for name, t in tiles.items()}, None)
    return ("split" if split else "int8"), tiles


def _head_gemv_rows(int4_max_tokens: int, q8_tiles, amx) -> int:
    """How many rows the head's steps take on its 8-bit blocks: one pass of the gemv kernel
    (3 rows), since a second pass widens and multiplies the blocks again. The head alone,
    [49152, 576] at 1 / 2 / 3 / 4 rows, took 0.72-0.77 / 1.16 / 1.46-1.48 / 2.12-2.17 ms on the
    8-bit blocks against 1.26-1.42 / 1.28-1.35 / 1.24-1.29 / 1.26-1.34 on the AMX kernel's bf16 copy; in the
    engine's 3-row steps the two were even, in its 4-row steps AMX saved 0.0-0.5 ms (HISTORY,
    session 25)."""
    if q8_tiles is None or amx is None:
        return int4_max_tokens
    return min(int4_max_tokens, Q8_HEAD_MAX_ROWS_BESIDE_AMX)


def _gemv_head(gemv, q8_tiles, bf16_tiles):
    """The head on the native kernels: its 8-bit blocks where the checkpoint has them, else its
    bf16 tiles, else None (oneDNN)."""
    if q8_tiles is not None:
        return _bound(native_gemv, "matmul_q8", gemv, q8_tiles)
    return None if bf16_tiles is None else _bound(native_gemv, "matmul_bf16", gemv, bf16_tiles)


def _bound(module, kernel: str, ops, weight):
    """x -> module.kernel(ops, x, weight), the kernel looked up per call (tests count calls)."""
    return lambda x: getattr(module, kernel)(ops, x, weight)


def _q4_tiles(q4_blocks: dict) -> dict:
    tiles = {}
    for name, blocks in q4_blocks.items():
        if native_amx.shape_supported(*blocks.q.shape):
            try:
                tiles[name] = native_amx.pack_q4(blocks.q, blocks.scale, blocks.zero)
            except ValueError:  # scales that are not float16: that matmul stays on oneDNN
                continue
    return tiles


def _q4a8_matmul(ops, tiles, split: bool):
    """x -> native_q4a8.matmul(ops, x, tiles, split), looked up per call (tests count calls)."""
    return lambda x: native_q4a8.matmul(ops, x, tiles, split)


def _q4a8_tiles(q4_blocks: dict) -> dict:
    tiles = {}
    for name, blocks in q4_blocks.items():
        try:
            tiles[name] = native_q4a8.pack(blocks.q, blocks.scale, blocks.zero)
        except ValueError:  # a shape or scales it cannot take: that matmul stays on oneDNN
            continue
    return tiles
