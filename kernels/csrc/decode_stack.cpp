// Every decoder layer of a decode step of a few rows in one call from Python.
//
// At one to a few rows a layer's ten ops each take microseconds (the 4-bit matmuls read ~2 MB,
// the norms and rope touch a few KB), and from Python each costs as much again in dispatch:
// the interpreter, torch's op call, the output's allocation. Over 30 layers that was ~1.5 ms of
// a ~7 ms step (BENCHMARKS.md). Here the layers call the very kernels the Python path calls
// (cpu_gemv.cpp, cpu_elementwise.cpp, paged_decode_binding.cpp) in the same order on the same
// buffers' contents, so the result is the Python path's bit for bit (tests check it); only the
// dispatch and allocations go. Every buffer of the step is carved from one allocation and
// reused by each layer.
//
// The model's part is bound once (DecodeStack: each layer's norm weights and 4-bit tiles);
// each step passes what changes: the residual stream, rope's tables, the caches and the rows.
// The matmuls of steps of up to gemv_max_rows rows run on the bf16 dot-product kernel
// (cpu_gemv.cpp); larger ones, up to vnni_max_rows where the build has it (KVRELAY_STACK_VNNI)
// and its tiles were given, on the VNNI kernel with activations coded twice
// (cpu_gemm_q4a8.cpp); larger still, up to amx_max_rows where the build has it
// (KVRELAY_STACK_AMX), on AMX tiles from the same 4-bit tiles (cpu_amx_gemm.cpp), as in Python.
// A bf16 checkpoint without 4-bit blocks gives bf16 tiles instead (the gemv kernel's bf16 form),
// taken up to gemv_max_rows only.
//
// The layer is each dense family's (models/arch.py, Form below): Llama's, with where a family
// asks for them q/k/v biases, 1 + w norms, Gemma's norms around attention and MLP, per-head
// q/k norms, the GELU-tanh gate, a sliding window per layer (each layer its KV group's block
// tables and slots), logit soft-capping and a rope table per layer.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_elementwise.h"
#include "cpu_gemv.h"
#include "paged_attention_ops.h"
#ifdef KVRELAY_STACK_VNNI
#include "cpu_gemm_q4a8.h"
#endif
#ifdef KVRELAY_STACK_AMX
#include "cpu_amx_gemm.h"
#endif

namespace {

constexpr int kMatmulsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj

// What a family's layer adds to Llama's (models/arch.py ArchSpec).
struct Form {
  bool norm_offset = false;  // norms scale by 1 + w (Gemma)
  bool sandwich = false;  // norms after attention and after the MLP too (Gemma)
  bool qk_norm = false;  // an RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
  bool gelu = false;  // the GELU-tanh gate, else SiLU
  double soft_cap = 0.0;  // attention logit soft-capping (Gemma 2; 0: none)

  // input, post-attention; then pre- and post-feedforward (sandwich); then q and k (qk_norm)
  int norms_per_layer() const { return 2 + (sandwich ? 2 : 0) + (qk_norm ? 2 : 0); }
};

// One matmul's weight in each kernel's layout.
struct Matmul {
  at::Tensor q4;  // 4-bit tiles for cpu_gemv.cpp (kernels/native_amx.py pack_q4), uint8
  at::Tensor vnni;  // the same blocks for cpu_gemm_q4a8.cpp (native_q4a8.py pack), or undefined
  at::Tensor bf16;  // or bf16 tiles for cpu_gemv.cpp (native_amx.py pack_bf16), q4 undefined
};

struct LayerWeights {
  // [hidden] bf16; pre_ff, post_ff with sandwich norms; q_norm, k_norm [head_dim] with qk_norm
  at::Tensor input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm;
  at::Tensor qkv_bias;  // [q_size + 2 kv_size] bf16, or undefined
  Matmul qkv, o, gate_up, down;
  int64_t window;  // sliding window (0: none)
};

struct Shape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
};

// One step's activations, each [rows, width] bf16, carved from one allocation.
struct Buffers {
  at::Tensor qkv, qk, attn, o, normed, gate_up, act, delta, scratch;

  Buffers(int64_t rows, const Shape& s, const at::TensorOptions& options) {
    const int64_t widths[] = {s.q_size() + 2 * s.kv_size(), s.q_size() + s.kv_size(), s.q_size(), s.hidden,
                              s.hidden, 2 * s.intermediate, s.intermediate, s.hidden, s.hidden};
    int64_t total = 0;
    for (int64_t width : widths) total += rows * width;
    const at::Tensor all = at::empty({total}, options);
    at::Tensor* slots[] = {&qkv, &qk, &attn, &o, &normed, &gate_up, &act, &delta, &scratch};
    int64_t offset = 0;
    for (int i = 0; i < 9; ++i) {
      *slots[i] = all.narrow(0, offset, rows * widths[i]).view({rows, widths[i]});
      offset += rows * widths[i];
    }
  }
};

// The step's rows as the decode attention kernel reads them (kernels/cpu_plan.py DecodeRows),
// per layer where layers differ: their rope table and their KV group's slots and block tables.
struct StepRows {
  const std::vector<at::Tensor>& cos;  // per layer [rows, 1, head_dim] bf16
  const std::vector<at::Tensor>& sin;
  const std::vector<at::Tensor>& slot_mapping;  // per layer [rows] int64
  at::Tensor token_ids;  // [rows] int64
  at::Tensor seq_lens;  // [rows] int32
  const std::vector<at::Tensor>& block_tables;  // per layer [rows, max_blocks] int32
};

class DecodeStack {
 public:
  // vnni_tiles: empty, or four per layer like tiles (the steps above gemv_max_rows rows, up to
  // vnni_max_rows). amx_max_rows: the steps above those on AMX tiles (0: none).
  // tiles: four 4-bit tiles per layer, or none and four bf16_tiles per layer (then the gemv
  // kernel's rows only). norms: Form::norms_per_layer() per layer; qkv_biases: none or one per
  // layer; windows: one per layer.
  DecodeStack(const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& tiles,
              const std::vector<at::Tensor>& vnni_tiles, const std::vector<at::Tensor>& bf16_tiles,
              const std::vector<at::Tensor>& qkv_biases, const std::vector<int64_t>& windows,
              int64_t gemv_max_rows, int64_t vnni_max_rows, int64_t amx_max_rows, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
              bool norm_offset, bool sandwich, bool qk_norm, bool gelu, double soft_cap)
      : form_{norm_offset, sandwich, qk_norm, gelu, soft_cap},
        gemv_max_rows_(gemv_max_rows),
        vnni_max_rows_(vnni_tiles.empty() ? gemv_max_rows : std::max(gemv_max_rows, vnni_max_rows)),
        amx_max_rows_(std::max(vnni_max_rows_, amx_max_rows)),
        eps_(eps),
        scale_(scale) {
    const size_t layers = windows.size();
    TORCH_CHECK(layers > 0 && norms.size() == layers * form_.norms_per_layer(),
                "norms: ", form_.norms_per_layer(), " per layer");
    TORCH_CHECK(tiles.empty() != bf16_tiles.empty(), "tiles or bf16_tiles, one of them");
    const std::vector<at::Tensor>& weights = tiles.empty() ? bf16_tiles : tiles;
    TORCH_CHECK(weights.size() == layers * kMatmulsPerLayer, "tiles: four per layer");
    TORCH_CHECK(vnni_tiles.empty() || vnni_tiles.size() == tiles.size(), "vnni_tiles: none or four per layer");
    TORCH_CHECK(tiles.size() || (vnni_tiles.empty() && amx_max_rows == 0),
                "bf16 tiles run on the gemv kernel only");
    TORCH_CHECK(qkv_biases.empty() || qkv_biases.size() == layers, "qkv_biases: none or one per layer");
#ifndef KVRELAY_STACK_VNNI
    TORCH_CHECK(vnni_tiles.empty(), "this build has no VNNI kernel");
#endif
#ifndef KVRELAY_STACK_AMX
    TORCH_CHECK(amx_max_rows == 0, "this build has no AMX kernel");
#endif
    shape_ = {norms[0].numel(), num_heads, num_kv_heads, head_dim, intermediate};
    TORCH_CHECK(shape_.q_size() > 0 && shape_.kv_size() > 0 && num_heads % num_kv_heads == 0,
                "heads must be a multiple of kv heads");
    for (size_t l = 0; l < layers; ++l) layers_.push_back(layer(l, norms, tiles, vnni_tiles, bf16_tiles, qkv_biases, windows));
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }
  // whether its kernels take a step of this many rows
  bool takes_rows(int64_t rows) const { return rows <= amx_max_rows_; }

  // residual [rows, hidden] bf16: the embeddings in, each layer's skip connections added in
  // place except the last MLP output, which is returned ([rows, hidden]; the caller adds it
  // before the final norm). k_caches, v_caches: one [num_blocks, block_size, kv_heads,
  // head_dim] each per layer.
  // cos, sin, slot_mappings, block_tables: one per layer (layers of one rope table or one KV
  // group may share the same tensors).
  at::Tensor run(const at::Tensor& residual, const std::vector<at::Tensor>& cos,
                 const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const std::vector<at::Tensor>& slot_mappings,
                 const at::Tensor& token_ids, const at::Tensor& seq_lens,
                 const std::vector<at::Tensor>& block_tables) const {
    TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kBFloat16 &&
                    residual.size(1) == shape_.hidden, "residual must be contiguous [rows, hidden] bf16");
    const size_t layers = layers_.size();
    TORCH_CHECK(k_caches.size() == layers && v_caches.size() == layers && cos.size() == layers &&
                    sin.size() == layers && slot_mappings.size() == layers && block_tables.size() == layers,
                "one K and V cache, rope table, slot mapping and block table per layer");
    const int64_t rows = residual.size(0);
    TORCH_CHECK(rows >= 1 && takes_rows(rows), "a step of ", rows, " rows is beyond this stack's kernels");
    const StepRows step{cos, sin, slot_mappings, token_ids, seq_lens, block_tables};
    for (size_t l = 0; l < layers; ++l) check_step(step, l, rows, k_caches[l]);
    Buffers buffers(rows, shape_, residual.options());
    for (size_t l = 0; l < layers; ++l) {
      const LayerWeights& w = layers_[l];
      const at::Tensor normed = l == 0 ? first_norm(residual, buffers) : skip_and_norm(residual, buffers, l);
      attention(w, l, normed, k_caches[l], v_caches[l], step, buffers);
      if (form_.sandwich) {  // the attention's output normalized before the skip add
        norm(buffers.scratch, buffers.o, w.post_norm);
        add_and_norm(buffers.normed, buffers.scratch, residual, w.pre_ff_norm);
      } else {
        add_and_norm(buffers.normed, buffers.o, residual, w.post_norm);
      }
      mlp(w, buffers);
    }
    return buffers.delta;
  }

 private:
  LayerWeights layer(size_t l, const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& tiles,
                     const std::vector<at::Tensor>& vnni_tiles, const std::vector<at::Tensor>& bf16_tiles,
                     const std::vector<at::Tensor>& qkv_biases, const std::vector<int64_t>& windows) const {
    Matmul m[kMatmulsPerLayer];
    for (int i = 0; i < kMatmulsPerLayer; ++i) {
      const size_t at = l * kMatmulsPerLayer + i;
      m[i] = {tiles.empty() ? at::Tensor() : tiles[at], vnni_tiles.empty() ? at::Tensor() : vnni_tiles[at],
              bf16_tiles.empty() ? at::Tensor() : bf16_tiles[at]};
    }
    const at::Tensor* n = norms.data() + l * form_.norms_per_layer();
    LayerWeights w{n[0], n[1], {}, {}, {}, {}, qkv_biases.empty() ? at::Tensor() : qkv_biases[l],
                   m[0], m[1], m[2], m[3], windows[l]};
    int next = 2;
    if (form_.sandwich) {
      w.pre_ff_norm = n[next++];
      w.post_ff_norm = n[next++];
    }
    if (form_.qk_norm) {
      w.q_norm = n[next++];
      w.k_norm = n[next++];
    }
    TORCH_CHECK(w.window >= 0, "a window is >= 0 (0: none)");
    return w;
  }

  // What every layer's kernels would check again, checked before the first K/V is stored, so
  // that a bad step fails before it writes anything.
  void check_step(const StepRows& step, size_t layer, int64_t rows, const at::Tensor& k_cache) const {
    const at::Tensor& cos = step.cos[layer];
    const at::Tensor& slot_mapping = step.slot_mapping[layer];
    const at::Tensor& block_tables = step.block_tables[layer];
    TORCH_CHECK(cos.numel() == rows * shape_.head_dim && step.sin[layer].numel() == cos.numel(),
                "cos, sin must be [rows, 1, head_dim]");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == rows, "slot_mapping must be contiguous int64 [rows]");
    TORCH_CHECK(k_cache.dim() == 4, "caches must be [num_blocks, block_size, kv_heads, head_dim]");
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slots[r] < num_slots, "slot ", slots[r], " lies outside the cache");
    TORCH_CHECK(step.token_ids.scalar_type() == at::kLong && step.token_ids.is_contiguous() &&
                    step.seq_lens.scalar_type() == at::kInt && step.seq_lens.is_contiguous() &&
                    step.seq_lens.numel() == step.token_ids.numel() && block_tables.dim() == 2 &&
                    block_tables.scalar_type() == at::kInt && block_tables.size(0) == step.token_ids.numel(),
                "token_ids int64 [n], seq_lens int32 [n], block_tables int32 [n, max_blocks]");
    const int64_t* tokens = step.token_ids.data_ptr<int64_t>();
    const int32_t* lens = step.seq_lens.data_ptr<int32_t>();
    const int64_t max_keys = block_tables.size(1) * k_cache.size(1);
    for (int64_t i = 0; i < step.token_ids.numel(); ++i) {
      TORCH_CHECK(tokens[i] >= 0 && tokens[i] < rows, "decode token index ", tokens[i], " out of range");
      TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_keys, "seq_len ", lens[i], " is < 1 or beyond the block table");
    }
  }

  void norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) const {
    kvrelay::rms_norm(out, x, weight, eps_, form_.norm_offset);
  }

  // residual += x, then out = the norm of it.
  void add_and_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& residual,
                    const at::Tensor& weight) const {
    kvrelay::add_rms_norm(out, x, residual, weight, eps_, form_.norm_offset);
  }

  at::Tensor first_norm(const at::Tensor& residual, Buffers& b) const {
    norm(b.normed, residual, layers_[0].input_norm);
    return b.normed;
  }

  // residual += the previous layer's MLP output, then this layer's input norm.
  at::Tensor skip_and_norm(const at::Tensor& residual, Buffers& b, size_t layer) const {
    add_and_norm(b.normed, b.delta, residual, layers_[layer].input_norm);
    return b.normed;
  }

  // out [rows, N] = x [rows, K] @ W^T on the kernel the Python path picks for this many rows.
  void matmul(const at::Tensor& out, const at::Tensor& x, const Matmul& w) const {
    const int64_t rows = x.size(0);
    if (rows <= gemv_max_rows_) {
      if (w.q4.defined())
        kvrelay::gemv_q4(out, x, w.q4);
      else
        kvrelay::gemv_bf16(out, x, w.bf16);
      return;
    }
#ifdef KVRELAY_STACK_VNNI
    if (rows <= vnni_max_rows_) {
      kvrelay::gemm_q4a8(out, x, w.vnni, /*split=*/true);
      return;
    }
#endif
#ifdef KVRELAY_STACK_AMX
    if (rows <= amx_max_rows_) {
      kvrelay::amx_gemm_q4(out, x, w.q4);
      return;
    }
#endif
    TORCH_CHECK(false, "no kernel in this build takes a step of ", rows, " rows");
  }

  // b.o = o_proj(attention(rope(q), rope(k), v)), the new K and V stored in the caches first.
  void attention(const LayerWeights& w, size_t layer, const at::Tensor& normed, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const StepRows& step, Buffers& b) const {
    const int64_t rows = normed.size(0), d = shape_.head_dim;
    const int64_t qk_heads = shape_.num_heads + shape_.num_kv_heads;
    matmul(b.qkv, normed, w.qkv);
    if (w.qkv_bias.defined()) b.qkv.add_(w.qkv_bias);  // bf16, rounded as torch's `out + bias`
    const at::Tensor qk_in = b.qkv.narrow(1, 0, qk_heads * d).view({rows, qk_heads, d});
    const at::Tensor qk = b.qk.view({rows, qk_heads, d});
    const at::Tensor& cos = step.cos[layer];
    const at::Tensor& sin = step.sin[layer];
    if (form_.qk_norm)
      kvrelay::qk_norm_rope(qk, qk_in, w.q_norm, w.k_norm, shape_.num_heads, eps_, form_.norm_offset, cos, sin);
    else
      kvrelay::rope(qk, qk_in, cos, sin);
    const at::Tensor q = qk.narrow(1, 0, shape_.num_heads);
    const at::Tensor k = qk.narrow(1, shape_.num_heads, shape_.num_kv_heads);
    const at::Tensor v = b.qkv.narrow(1, qk_heads * d, shape_.kv_size()).view({rows, shape_.num_kv_heads, d});
    kvrelay::store_kv_op(k, v, k_cache, v_cache, step.slot_mapping[layer]);
    const at::Tensor attn = b.attn.view({rows, shape_.num_heads, d});
    kvrelay::paged_decode_attention_op(attn, q, k_cache, v_cache, step.token_ids, step.seq_lens,
                                       step.block_tables[layer], scale_, w.window, form_.soft_cap);
    matmul(b.o, b.attn, w.o);
  }

  // b.delta = down(act(gate) * up) of b.normed (then its own norm, with sandwich norms).
  void mlp(const LayerWeights& w, Buffers& b) const {
    matmul(b.gate_up, b.normed, w.gate_up);
    if (form_.gelu)
      kvrelay::gelu_tanh_and_mul(b.act, b.gate_up);
    else
      kvrelay::silu_and_mul(b.act, b.gate_up);
    if (!form_.sandwich) {
      matmul(b.delta, b.act, w.down);
      return;
    }
    matmul(b.scratch, b.act, w.down);
    norm(b.delta, b.scratch, w.post_ff_norm);
  }

  Form form_;
  std::vector<LayerWeights> layers_;
  Shape shape_{};
  int64_t gemv_max_rows_, vnni_max_rows_, amx_max_rows_;  // each kernel's rows, cumulative
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool, bool, bool, bool,
                          double>(),
           pybind11::arg("norms"), pybind11::arg("tiles"), pybind11::arg("vnni_tiles"),
           pybind11::arg("bf16_tiles"), pybind11::arg("qkv_biases"), pybind11::arg("windows"),
           pybind11::arg("gemv_max_rows"), pybind11::arg("vnni_max_rows"), pybind11::arg("amx_max_rows"),
           pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("intermediate"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("norm_offset"),
           pybind11::arg("sandwich"), pybind11::arg("qk_norm"), pybind11::arg("gelu"),
           pybind11::arg("soft_cap"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("takes_rows", &DecodeStack::takes_rows)
      .def_property_readonly_static("has_vnni", [](pybind11::object) {
#ifdef KVRELAY_STACK_VNNI
        return true;
#else
        return false;
#endif
      })
      .def_property_readonly_static("has_amx", [](pybind11::object) {
#ifdef KVRELAY_STACK_AMX
        return true;
#else
        return false;
#endif
      })
      // without the GIL: the worker's other Python threads go on while the layers run
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "The layers of a decode step; returns the last MLP output");
}
