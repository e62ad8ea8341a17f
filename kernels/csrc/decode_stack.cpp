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

constexpr int kNormsPerLayer = 2;  // input_layernorm, post_attention_layernorm
constexpr int kMatmulsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj

// One matmul's weight in each kernel's layout.
struct Matmul {
  at::Tensor q4;  // 4-bit tiles for cpu_gemv.cpp (kernels/native_amx.py pack_q4), uint8
  at::Tensor vnni;  // the same blocks for cpu_gemm_q4a8.cpp (native_q4a8.py pack), or undefined
};

struct LayerWeights {
  at::Tensor input_norm, post_norm;  // [hidden] bf16
  Matmul qkv, o, gate_up, down;
};

struct Shape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
};

// One step's activations, each [rows, width] bf16, carved from one allocation.
struct Buffers {
  at::Tensor qkv, qk, attn, o, normed, gate_up, act, delta;

  Buffers(int64_t rows, const Shape& s, const at::TensorOptions& options) {
    const int64_t widths[] = {s.q_size() + 2 * s.kv_size(), s.q_size() + s.kv_size(), s.q_size(), s.hidden,
                              s.hidden, 2 * s.intermediate, s.intermediate, s.hidden};
    int64_t total = 0;
    for (int64_t width : widths) total += rows * width;
    const at::Tensor all = at::empty({total}, options);
    at::Tensor* slots[] = {&qkv, &qk, &attn, &o, &normed, &gate_up, &act, &delta};
    int64_t offset = 0;
    for (int i = 0; i < 8; ++i) {
      *slots[i] = all.narrow(0, offset, rows * widths[i]).view({rows, widths[i]});
      offset += rows * widths[i];
    }
  }
};

// The step's rows as the decode attention kernel reads them (kernels/cpu_plan.py DecodeRows).
struct StepRows {
  at::Tensor cos, sin;  // [rows, 1, head_dim] bf16
  at::Tensor slot_mapping;  // [rows] int64
  at::Tensor token_ids;  // [rows] int64
  at::Tensor seq_lens;  // [rows] int32
  at::Tensor block_tables;  // [rows, max_blocks] int32
};

class DecodeStack {
 public:
  // vnni_tiles: empty, or four per layer like tiles (the steps above gemv_max_rows rows, up to
  // vnni_max_rows). amx_max_rows: the steps above those on AMX tiles (0: none).
  DecodeStack(const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& tiles,
              const std::vector<at::Tensor>& vnni_tiles, int64_t gemv_max_rows, int64_t vnni_max_rows,
              int64_t amx_max_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t intermediate, double eps, double scale)
      : gemv_max_rows_(gemv_max_rows),
        vnni_max_rows_(vnni_tiles.empty() ? gemv_max_rows : std::max(gemv_max_rows, vnni_max_rows)),
        amx_max_rows_(std::max(vnni_max_rows_, amx_max_rows)),
        eps_(eps),
        scale_(scale) {
    TORCH_CHECK(!norms.empty() && norms.size() % kNormsPerLayer == 0, "norms: two per layer");
    const size_t layers = norms.size() / kNormsPerLayer;
    TORCH_CHECK(tiles.size() == layers * kMatmulsPerLayer, "tiles: four per layer");
    TORCH_CHECK(vnni_tiles.empty() || vnni_tiles.size() == tiles.size(), "vnni_tiles: none or four per layer");
#ifndef KVRELAY_STACK_VNNI
    TORCH_CHECK(vnni_tiles.empty(), "this build has no VNNI kernel");
#endif
#ifndef KVRELAY_STACK_AMX
    TORCH_CHECK(amx_max_rows == 0, "this build has no AMX kernel");
#endif
    shape_ = {norms[0].numel(), num_heads, num_kv_heads, head_dim, intermediate};
    TORCH_CHECK(shape_.q_size() > 0 && shape_.kv_size() > 0 && num_heads % num_kv_heads == 0,
                "heads must be a multiple of kv heads");
    for (size_t l = 0; l < layers; ++l) {
      Matmul m[kMatmulsPerLayer];
      for (int i = 0; i < kMatmulsPerLayer; ++i) {
        const size_t at = l * kMatmulsPerLayer + i;
        m[i] = {tiles[at], vnni_tiles.empty() ? at::Tensor() : vnni_tiles[at]};
      }
      layers_.push_back({norms[l * kNormsPerLayer], norms[l * kNormsPerLayer + 1], m[0], m[1], m[2], m[3]});
    }
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }
  // whether its kernels take a step of this many rows
  bool takes_rows(int64_t rows) const { return rows <= amx_max_rows_; }

  // residual [rows, hidden] bf16: the embeddings in, each layer's skip connections added in
  // place except the last MLP output, which is returned ([rows, hidden]; the caller adds it
  // before the final norm). k_caches, v_caches: one [num_blocks, block_size, kv_heads,
  // head_dim] each per layer.
  at::Tensor run(const at::Tensor& residual, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                 const at::Tensor& slot_mapping, const at::Tensor& token_ids, const at::Tensor& seq_lens,
                 const at::Tensor& block_tables) const {
    TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kBFloat16 &&
                    residual.size(1) == shape_.hidden, "residual must be contiguous [rows, hidden] bf16");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    const int64_t rows = residual.size(0);
    TORCH_CHECK(rows >= 1 && takes_rows(rows), "a step of ", rows, " rows is beyond this stack's kernels");
    const StepRows step{cos, sin, slot_mapping, token_ids, seq_lens, block_tables};
    check_step(step, rows, k_caches[0]);
    Buffers buffers(rows, shape_, residual.options());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const at::Tensor normed = l == 0 ? first_norm(residual, buffers) : skip_and_norm(residual, buffers, l);
      attention(layers_[l], normed, k_caches[l], v_caches[l], step, buffers);
      kvrelay::add_rms_norm(buffers.normed, buffers.o, residual, layers_[l].post_norm, eps_);
      mlp(layers_[l], buffers);
    }
    return buffers.delta;
  }

 private:
  // What every layer's kernels would check again, checked before the first K/V is stored, so
  // that a bad step fails before it writes anything.
  void check_step(const StepRows& step, int64_t rows, const at::Tensor& k_cache) const {
    TORCH_CHECK(step.cos.numel() == rows * shape_.head_dim && step.sin.numel() == step.cos.numel(),
                "cos, sin must be [rows, 1, head_dim]");
    TORCH_CHECK(step.slot_mapping.scalar_type() == at::kLong && step.slot_mapping.is_contiguous() &&
                    step.slot_mapping.numel() == rows, "slot_mapping must be contiguous int64 [rows]");
    TORCH_CHECK(k_cache.dim() == 4, "caches must be [num_blocks, block_size, kv_heads, head_dim]");
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slots[r] < num_slots, "slot ", slots[r], " lies outside the cache");
    TORCH_CHECK(step.token_ids.scalar_type() == at::kLong && step.token_ids.is_contiguous() &&
                    step.seq_lens.scalar_type() == at::kInt && step.seq_lens.is_contiguous() &&
                    step.seq_lens.numel() == step.token_ids.numel() && step.block_tables.dim() == 2 &&
                    step.block_tables.scalar_type() == at::kInt && step.block_tables.size(0) == step.token_ids.numel(),
                "token_ids int64 [n], seq_lens int32 [n], block_tables int32 [n, max_blocks]");
    const int64_t* tokens = step.token_ids.data_ptr<int64_t>();
    const int32_t* lens = step.seq_lens.data_ptr<int32_t>();
    const int64_t max_keys = step.block_tables.size(1) * k_cache.size(1);
    for (int64_t i = 0; i < step.token_ids.numel(); ++i) {
      TORCH_CHECK(tokens[i] >= 0 && tokens[i] < rows, "decode token index ", tokens[i], " out of range");
      TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_keys, "seq_len ", lens[i], " is < 1 or beyond the block table");
    }
  }

  at::Tensor first_norm(const at::Tensor& residual, Buffers& b) const {
    kvrelay::rms_norm(b.normed, residual, layers_[0].input_norm, eps_);
    return b.normed;
  }

  // residual += the previous layer's MLP output, then this layer's input norm.
  at::Tensor skip_and_norm(const at::Tensor& residual, Buffers& b, size_t layer) const {
    kvrelay::add_rms_norm(b.normed, b.delta, residual, layers_[layer].input_norm, eps_);
    return b.normed;
  }

  // out [rows, N] = x [rows, K] @ W^T on the kernel the Python path picks for this many rows.
  void matmul(const at::Tensor& out, const at::Tensor& x, const Matmul& w) const {
    const int64_t rows = x.size(0);
    if (rows <= gemv_max_rows_) {
      kvrelay::gemv_q4(out, x, w.q4);
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
  void attention(const LayerWeights& w, const at::Tensor& normed, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const StepRows& step, Buffers& b) const {
    const int64_t rows = normed.size(0), d = shape_.head_dim;
    const int64_t qk_heads = shape_.num_heads + shape_.num_kv_heads;
    matmul(b.qkv, normed, w.qkv);
    const at::Tensor qk_in = b.qkv.narrow(1, 0, qk_heads * d).view({rows, qk_heads, d});
    const at::Tensor qk = b.qk.view({rows, qk_heads, d});
    kvrelay::rope(qk, qk_in, step.cos, step.sin);
    const at::Tensor q = qk.narrow(1, 0, shape_.num_heads);
    const at::Tensor k = qk.narrow(1, shape_.num_heads, shape_.num_kv_heads);
    const at::Tensor v = b.qkv.narrow(1, qk_heads * d, shape_.kv_size()).view({rows, shape_.num_kv_heads, d});
    kvrelay::store_kv_op(k, v, k_cache, v_cache, step.slot_mapping);
    const at::Tensor attn = b.attn.view({rows, shape_.num_heads, d});
    // The stack runs models without a sliding window or soft cap (DecodeStack.fits).
    kvrelay::paged_decode_attention_op(attn, q, k_cache, v_cache, step.token_ids, step.seq_lens,
                                       step.block_tables, scale_, /*window=*/0, /*soft_cap=*/0.0);
    matmul(b.o, b.attn, w.o);
  }

  // b.delta = down(silu(gate) * up) of b.normed.
  void mlp(const LayerWeights& w, Buffers& b) const {
    matmul(b.gate_up, b.normed, w.gate_up);
    kvrelay::silu_and_mul(b.act, b.gate_up);
    matmul(b.delta, b.act, w.down);
  }

  std::vector<LayerWeights> layers_;
  Shape shape_{};
  int64_t gemv_max_rows_, vnni_max_rows_, amx_max_rows_;  // each kernel's rows, cumulative
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, double, double>(),
           pybind11::arg("norms"), pybind11::arg("tiles"), pybind11::arg("vnni_tiles"),
           pybind11::arg("gemv_max_rows"), pybind11::arg("vnni_max_rows"), pybind11::arg("amx_max_rows"),
           pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("intermediate"),
           pybind11::arg("eps"), pybind11::arg("scale"))
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
