"""GGUF files of the tiny family checkpoints (checkpoints.py), written with the `gguf` package
in the layout of llama.cpp's converter (convert_hf_to_gguf.py): its tensor names, the
architecture's metadata keys, q/k rows permuted for Llama only (its rotary pairs interleaved;
Qwen3 and Gemma keep HF's order), Gemma's norms stored as 1 + w, 1-D tensors in F32 whatever
the file type, and the tokenizer of the default model's GGUF copied key by key.

Quantized files hold the layer matmuls in Q4_0 (or Q4_1) and the embedding and head in Q8_0,
packed by gguf.quants, which lays the blocks out as ggml does. `Q4_K_MIX` writes the layer
matmuls as llama.cpp's Q4_K_M mixes them: Q4_K (tests/quantized/q4_k_writer.py, as gguf.quants
has no Q4_K quantizer), with attn_v and ffn_down in a wider type (Q8_0 here; Q6_K there).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from kvrelay.engine.model_loader import default_gguf_path
from tests.quantized.q4_k_writer import quantize_q4_k

# HF layer module -> llama.cpp tensor (blk.N.<name>), for the families written here
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# where the post-attention norm goes: before the MLP (Llama, Qwen3), or after attention with
# Gemma's own pre/post feed-forward norms
_PLAIN_NORMS = {"post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class Layout:
    """How llama.cpp's converter writes one architecture."""
    arch: str  # general.architecture, the metadata keys' prefix
    norms: dict
    permute_qk: bool = False  # LlamaModel.permute: each head's rotary halves interleaved
    norm_shift: float = 0.0  # Gemma: norm weights stored as shift + w


LAYOUTS = {"llama": Layout("llama", _PLAIN_NORMS, permute_qk=True),
           "qwen3": Layout("qwen3", _PLAIN_NORMS),
           "gemma3_text": Layout("gemma3", _GEMMA_NORMS, norm_shift=1.0)}


def write_gguf(hf_model, path: Path, matmul_type: str = "F32", arch: str | None = None) -> Path:
    """hf_model: a tiny HF causal LM (checkpoints.py). matmul_type: F32, or Q4_0 / Q4_1 for the
    layer matmuls (the embedding and head then Q8_0). arch: the file's general.architecture
    where it is not the layout's own (a file of an architecture kvrelay lacks)."""
    config = hf_model.config
    layout = LAYOUTS[config.model_type]
    writer = GGUFWriter(str(path), arch or layout.arch)
    writer.add_name(f"tiny-{config.model_type}")
    _add_hparams(writer, config, layout)
    file_type = {"F32": "ALL_F32", "Q4_K_MIX": "MOSTLY_Q4_K_M"}.get(matmul_type,
                                                                   f"MOSTLY_{matmul_type}")
    writer.add_file_type(int(LlamaFileType[file_type]))
    writer.add_quantization_version(2)
    _copy_tokenizer(writer)
    for name, array in _gguf_tensors(hf_model, layout):
        _add_tensor(writer, name, array, matmul_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hparams(writer: GGUFWriter, config, layout: Layout) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters
    if layout.arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if layout.arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)


def _copy_tokenizer(writer: GGUFWriter) -> None:
    """Every tokenizer.* key of the default model's GGUF, with its value types."""
    for key, field in GGUFReader(default_gguf_path()).fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def _gguf_tensors(hf_model, layout: Layout):
    """(llama.cpp name, float32 array in its row order) for every weight of the model."""
    config = hf_model.config
    layer_names = {**_LAYER_TENSORS, **layout.norms}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is token_embd itself
        array = tensor.detach().float().numpy()
        if name in _GLOBAL_TENSORS:
            gguf_name = _GLOBAL_TENSORS[name]
        else:
            _, _, layer, module_name = name.removesuffix(".weight").split(".", 3)
            piece = layer_names[module_name]
            gguf_name = f"blk.{layer}.{piece}.weight"
            if layout.permute_qk and piece in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if piece == "attn_q" \
                    else config.num_key_value_heads
                array = interleave_rotary_halves(array, heads)
        if gguf_name.endswith("norm.weight"):
            array = array + np.float32(layout.norm_shift)
        yield gguf_name, array


def interleave_rotary_halves(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation of Llama's q/k rows: within each head, row i of the first half
    and row i of the second become rows 2i and 2i + 1. weight [num_heads * head_dim, ...]."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _add_tensor(writer: GGUFWriter, name: str, array: np.ndarray, matmul_type: str) -> None:
    if array.ndim == 1 or matmul_type == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    piece = name.split(".")[-2]
    if matmul_type == "Q4_K_MIX":
        matmul_type = "Q8_0" if piece in _WIDER_IN_Q4_K_M else "Q4_K"
    qtype = GGMLQuantizationType[matmul_type if piece in _MATMULS else "Q8_0"]
    array = np.ascontiguousarray(array)
    packed = quantize_q4_k(array) if qtype == GGMLQuantizationType.Q4_K else quantize(array, qtype)
    writer.add_tensor(name, packed, raw_dtype=qtype)


_WIDER_IN_Q4_K_M = frozenset({"attn_v", "ffn_down"})

