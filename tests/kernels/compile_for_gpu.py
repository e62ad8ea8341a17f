"""Compiles the Triton kernels down to a CUDA binary without a GPU (run in a subprocess, since
TRITON_INTERPRET must be off): GPU-only compile errors show up even on CPU-only CI."""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvrelay.kernels.triton_lora import _expand_kernel, _shrink_kernel
from kvrelay.kernels.triton_moe import _down_kernel, _gate_up_kernel
from kvrelay.kernels.triton_paged_attention import _paged_attention_kernel
from kvrelay.kernels.triton_rejection import _rejection_kernel
from kvrelay.kernels.triton_store_kv import _store_kv_kernel, store_kv_triton

HOPPER = GPUTarget("cuda", 90, 32)


def _signature(kernel, pointer_types: dict, constexprs: dict) -> dict:
    return {
        name: "constexpr" if name in constexprs else pointer_types.get(name, "i32") for name in kernel.arg_names
    }


def compile_attention(dtype: str, group_size: int, block_m: int, head_dim_padded: int, window: bool = False,
                      soft_cap: bool = False, kv_code: int = 0):
    """kv_code > 0: an 8-bit cache (KV_CODES), read as bytes with fp32 queries."""
    constexprs = dict(
        GROUP_SIZE=group_size, BLOCK_Q=block_m // group_size, BLOCK_M=block_m, TILE_N=32,
        HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=16, DOT_IN_FP32=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", HAS_WINDOW=window, HAS_SOFT_CAP=soft_cap,
        KV_CODE=kv_code,
    )
    cache_type = "*u8" if kv_code else f"*{dtype}"
    scale_type = "*fp32" if kv_code else f"*{dtype}"
    pointers = {"out_ptr": f"*{dtype}", "query_ptr": f"*{dtype}", "k_cache_ptr": cache_type,
                "v_cache_ptr": cache_type, "k_scale_ptr": scale_type, "v_scale_ptr": scale_type}
    pointers.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", cu_seqlens_q_ptr="*i32", qk_scale_log2="fp32",
                    soft_cap_log2="fp32")
    signature = _signature(_paged_attention_kernel, pointers, constexprs)
    return triton.compile(ASTSource(_paged_attention_kernel, signature, constexprs), target=HOPPER)


def compile_store(dtype: str):
    constexprs = dict(HEADS_PADDED=4, HEAD_DIM_PADDED=64)
    pointers = {name: f"*{dtype}" for name in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers["slot_mapping_ptr"] = "*i64"
    signature = _signature(_store_kv_kernel, pointers, constexprs)
    return triton.compile(ASTSource(_store_kv_kernel, signature, constexprs), target=HOPPER)


def compile_rejection():
    constexprs = dict(BLOCK=1024)
    pointers = dict(probs_ptr="*fp32", draft_ptr="*i64", uniform_ptr="*fp64", out_ptr="*i64")
    signature = _signature(_rejection_kernel, pointers, constexprs)
    return triton.compile(ASTSource(_rejection_kernel, signature, constexprs), target=HOPPER)


def compile_moe(dtype: str, block_m: int):
    tiles = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, DOT_IN_FP32=False,
                 DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    shared = dict(sorted_pairs_ptr="*i32", block_experts_ptr="*i32")
    gate_up_constexprs = dict(tiles, ACTIVATION=0)
    pointers = dict(shared, hidden_ptr=f"*{dtype}", w13_ptr=f"*{dtype}", act_ptr=f"*{dtype}")
    signature = _signature(_gate_up_kernel, pointers, gate_up_constexprs)
    triton.compile(ASTSource(_gate_up_kernel, signature, gate_up_constexprs), target=HOPPER)
    pointers = dict(shared, act_ptr=f"*{dtype}", w2_ptr=f"*{dtype}", weights_ptr="*fp32",
                    out_ptr="*fp32")
    signature = _signature(_down_kernel, pointers, tiles)
    return triton.compile(ASTSource(_down_kernel, signature, tiles), target=HOPPER)


def compile_lora(dtype: str, block_tokens: int, block_ranks: int):
    """The batched LoRA shrink and expand; block_tokens 1: per-token programs only, else the
    one-slot tile (tl.dot) and mixed-block paths too."""
    shrink_constexprs = dict(BLOCK_T=block_tokens, BLOCK_R=block_ranks,
                             BLOCK_K=128 if block_ranks <= 32 else 64, DOT_IN_FP32=False,
                             DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    pointers = dict(x_ptr=f"*{dtype}", a_ptr=f"*{dtype}", out_ptr="*fp32", slots_ptr="*i32")
    signature = _signature(_shrink_kernel, pointers, shrink_constexprs)
    shrink = triton.compile(ASTSource(_shrink_kernel, signature, shrink_constexprs), target=HOPPER)
    expand_constexprs = dict(BLOCK_T=block_tokens, BLOCK_R=block_ranks,
                             BLOCK_N=128 if block_tokens == 1 else 64)
    pointers = dict(y_ptr=f"*{dtype}", xa_ptr="*fp32", b_ptr=f"*{dtype}", slots_ptr="*i32")
    signature = _signature(_expand_kernel, pointers, expand_constexprs)
    triton.compile(ASTSource(_expand_kernel, signature, expand_constexprs), target=HOPPER)
    return shrink


if __name__ == "__main__":
    bf16_prefill = compile_attention("bf16", group_size=3, block_m=64, head_dim_padded=64)
    assert "wgmma" in bf16_prefill.asm["ptx"], "bf16 attention should use Hopper tensor cores"
    compile_attention("fp32", group_size=8, block_m=16, head_dim_padded=128)
    windowed = compile_attention("bf16", group_size=3, block_m=64, head_dim_padded=64, window=True, soft_cap=True)
    assert "wgmma" in windowed.asm["ptx"], "windowed, capped bf16 attention should use Hopper tensor cores"
    compile_attention("fp32", group_size=1, block_m=16, head_dim_padded=64, window=True)
    for kv_code in (1, 2, 3):  # int8, fp8_e4m3, fp8_e5m2 caches
        compile_attention("fp32", group_size=3, block_m=64, head_dim_padded=64, kv_code=kv_code)
    compile_store("bf16")
    compile_rejection()
    compile_moe("bf16", block_m=16)
    compile_moe("fp32", block_m=64)
    compile_lora("bf16", block_tokens=1, block_ranks=16)
    bf16_lora_tiles = compile_lora("bf16", block_tokens=32, block_ranks=16)
    assert "mma" in bf16_lora_tiles.asm["ptx"], "bf16 LoRA shrink tiles should use tensor cores"
    compile_lora("fp16", block_tokens=16, block_ranks=64)
    compile_lora("fp32", block_tokens=16, block_ranks=64)
    try:  # compiled kernels cannot take CPU tensors: expect the explicit error, not a crash
        cache = torch.zeros(1, 16, 1, 64)
        store_kv_triton(torch.ones(1, 1, 64), torch.ones(1, 1, 64), cache, cache, torch.tensor([0]))
        raise AssertionError("store_kv_triton ran on CPU tensors outside the interpreter")
    except RuntimeError as error:
        assert "TRITON_INTERPRET" in str(error)
    print("compiled")
