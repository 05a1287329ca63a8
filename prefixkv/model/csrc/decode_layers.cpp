// The decoder layers of a decode-only step in one call (LlamaModel's fused decode path, model/llama.py).
//
// A decode step of one stream reads every weight once and computes little else, so whatever runs between the
// matrix products is a visible share of it. This loop runs the same kernels on the same values in the same order
// as the Python layers do (rms_norm, the row-invariant gemm or qgemm, rotary, the pool write, paged_flash_decode,
// silu_mul, the residual adds), so its results are the Python path's, bit for bit. It calls them on raw rows of
// one workspace allocated per call (fused_ops.h, gemm.h, gemm_q.h, flash_attention.h): no interpreter, and no
// ATen dispatch, tensor or allocation per kernel. Those cost little when warm, but each layer's weight stream
// evicts them from the caches, so that they took 25-30 us a layer, ~0.9 ms a step, on AMD EPYC; see
// docs/benchmarks/decode/amd_epyc/README.md for the measurement. The inputs are checked once per call.
// It covers what the fused decode path runs: every row a single-token decode attended in place with the
// cache-invariant kernel, fused ops, a row-invariant matmul; per-head q/k norms (Qwen3) where the layers have them.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "flash_attention.h"
#include "fused_ops.h"
#include "gemm.h"
#include "gemm_q.h"

bool has_amx();  // gemm/gemm_amx.cpp

namespace {

using bf16 = c10::BFloat16;
namespace gemm = prefixkv::gemm;
namespace qgemm = prefixkv::qgemm;
namespace ops = prefixkv::ops;

// A packed matmul weight of n outputs over k inputs: bf16 panels (gemm) or GGUF blocks (qgemm, with a format)
struct Weight {
  at::Tensor packed;
  c10::optional<qgemm::Format> format;
  int64_t n, k;

  Weight(at::Tensor p, const std::string& fmt, int64_t out, int64_t in, const char* name)
      : packed(std::move(p)), n(out), k(in) {
    TORCH_CHECK(packed.is_contiguous() && k % 2 == 0, "DecodeLayers: ", name, " must be packed, with an even K");
    if (fmt.empty()) {
      TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 3 && packed.size(0) == gemm::panels_of(n) &&
                      packed.size(1) == k / 2 && packed.size(2) == gemm::kPairRow,
                  "DecodeLayers: ", name, " must come from gemm_pack of a [", n, ", ", k, "] weight");
    } else {
      format = qgemm::parse_format(fmt, "DecodeLayers");
      TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(0) == qgemm::panels_of(n) &&
                      packed.size(1) * qgemm::kBlock == k && packed.size(2) == qgemm::panel_block_bytes(*format),
                  "DecodeLayers: ", name, " must come from qgemm_pack of a [", n, ", ", k, "] ", fmt, " weight");
    }
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // the norms' weights, contiguous
  Weight qkv, o, gate_up, down;
  c10::optional<at::Tensor> qkv_bias;
  c10::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorm weights [head_dim] (Qwen3), both or neither
};

// Pieces of one allocation of T, each starting on a 64-byte line
template <class T>
class Pieces {
 public:
  Pieces(const std::vector<int64_t>& counts, const at::TensorOptions& options) {
    int64_t total = 0;
    for (int64_t count : counts) total += round_up(count);
    storage_ = at::empty({total * static_cast<int64_t>(sizeof(T))}, options.dtype(at::kByte));
    T* next = reinterpret_cast<T*>(storage_.data_ptr<uint8_t>());
    for (int64_t count : counts) {
      pieces_.push_back(next);
      next += round_up(count);
    }
  }
  T* operator[](size_t i) const { return pieces_[i]; }

 private:
  static int64_t round_up(int64_t count) {
    constexpr int64_t per_line = 64 / static_cast<int64_t>(sizeof(T));
    return (count + per_line - 1) / per_line * per_line;
  }
  at::Tensor storage_;
  std::vector<T*> pieces_;
};

c10::optional<at::Tensor> contiguous(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(t->contiguous()) : c10::nullopt;
}

// fn(r) for every row, in parallel from 16 rows on (as the tensor kernels share out their rows)
template <class Fn>
void each_row(int64_t rows, const Fn& fn) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

}  // namespace

class DecodeLayers {
 public:
  // Per layer, in order: input norm weight, packed q/k/v (fused), q/k/v bias or None, the per-head q and k norm
  // weights or None, packed o, post-attention norm weight, packed gate/up (fused), packed down; formats: per
  // layer, the block formats of q/k/v, o, gate/up and down ("" for bf16 panels). amx: the bf16 matmuls run on AMX
  // tiles (else AVX512_BF16).
  DecodeLayers(const std::vector<at::Tensor>& input_norm, const std::vector<at::Tensor>& qkv,
               const std::vector<c10::optional<at::Tensor>>& qkv_bias,
               const std::vector<c10::optional<at::Tensor>>& q_norm,
               const std::vector<c10::optional<at::Tensor>>& k_norm, const std::vector<at::Tensor>& o,
               const std::vector<at::Tensor>& post_norm, const std::vector<at::Tensor>& gate_up,
               const std::vector<at::Tensor>& down, const std::vector<std::vector<std::string>>& formats,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
               bool amx)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), hidden_(hidden), intermediate_(intermediate),
        eps_(static_cast<float>(eps)), amx_(amx) {
    const size_t n = input_norm.size();
    TORCH_CHECK(qkv.size() == n && qkv_bias.size() == n && q_norm.size() == n && k_norm.size() == n &&
                    o.size() == n && post_norm.size() == n && gate_up.size() == n && down.size() == n &&
                    formats.size() == n,
                "DecodeLayers: one of each weight per layer");
    TORCH_CHECK((head_dim == 64 || head_dim == 128) && kv_heads >= 1 && heads % kv_heads == 0 &&
                    heads / kv_heads <= 64,
                "DecodeLayers: the decode attention kernel needs head_dim 64 or 128 and whole query groups");
    TORCH_CHECK(hidden % 16 == 0 && intermediate % 16 == 0, "DecodeLayers: hidden and intermediate sizes % 16");
    TORCH_CHECK(!amx || has_amx(), "DecodeLayers: this CPU or OS does not offer AMX tiles");
    const int64_t q_size = heads * head_dim, qkv_size = q_size + 2 * kv_heads * head_dim;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(formats[i].size() == 4, "DecodeLayers: four formats per layer (q/k/v, o, gate/up, down)");
      for (const at::Tensor* norm : {&input_norm[i], &post_norm[i]})
        TORCH_CHECK(norm->scalar_type() == at::kBFloat16 && norm->numel() == hidden, "DecodeLayers: bf16 norms");
      TORCH_CHECK(q_norm[i].has_value() == k_norm[i].has_value(), "DecodeLayers: q and k norms come together");
      for (const c10::optional<at::Tensor>* norm : {&q_norm[i], &k_norm[i]})
        TORCH_CHECK(!norm->has_value() || ((*norm)->scalar_type() == at::kBFloat16 && (*norm)->numel() == head_dim),
                    "DecodeLayers: the per-head q/k norms must be bf16 [", head_dim, "]");
      if (qkv_bias[i].has_value())
        TORCH_CHECK(qkv_bias[i]->scalar_type() == at::kBFloat16 && qkv_bias[i]->numel() == qkv_size,
                    "DecodeLayers: the q/k/v bias must be bf16 [", qkv_size, "]");
      layers_.push_back({input_norm[i].contiguous(), post_norm[i].contiguous(),
                         Weight(qkv[i], formats[i][0], qkv_size, hidden, "q/k/v"),
                         Weight(o[i], formats[i][1], hidden, q_size, "o"),
                         Weight(gate_up[i], formats[i][2], 2 * intermediate, hidden, "gate/up"),
                         Weight(down[i], formats[i][3], hidden, intermediate, "down"),
                         contiguous(qkv_bias[i]), contiguous(q_norm[i]), contiguous(k_norm[i])});
    }
  }

  // h [B, hidden] bf16, one row per decode (updated in place and returned); cos/sin [B, 1, head_dim] the rows'
  // rotary tables; kv_cache [layers, 2, kv_heads, slots, head_dim]; slot_mapping [B] where each row's K/V go;
  // table / lens the rows' page tables and context lengths (paged_flash_decode's)
  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, const at::Tensor& table, const at::Tensor& lens, int64_t page_size,
                 double scale, int64_t isa) const {
    const int64_t rows = h.size(0), d = head_dim_, q_size = heads_ * d, kv_size = kv_heads_ * d;
    const int64_t qkv_size = q_size + 2 * kv_size, qk_size = q_size + kv_size;
    check(h, cos, sin, kv_cache, slot_mapping, table, lens, page_size, isa);
    // the step's buffers: normed, q/k/v, rotated q/k, attended, projected, gate/up, act, per-head normed q/k;
    // lse, q4_1's block sums
    const Pieces<bf16> b({rows * hidden_, rows * qkv_size, rows * qk_size, rows * q_size, rows * hidden_,
                          rows * 2 * intermediate_, rows * intermediate_, rows * qk_size},
                         h.options());
    bf16 *normed = b[0], *qkv = b[1], *qk = b[2], *attended = b[3], *projected = b[4], *gate_up = b[5], *act = b[6];
    bf16* head_normed = b[7];
    const int64_t max_blocks = std::max({hidden_, q_size, intermediate_}) / qgemm::kBlock;
    const Pieces<float> f({rows * heads_, rows * max_blocks}, h.options());
    float *lse = f[0], *xsum = f[1];

    bf16* hp = h.data_ptr<bf16>();
    const bf16 *cp = cos.data_ptr<bf16>(), *sp = sin.data_ptr<bf16>();
    const int64_t cs_stride = cos.stride(0);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    bf16* pool = kv_cache.data_ptr<bf16>();
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    const int64_t head_stride = kv_cache.stride(2), slot_stride = kv_cache.stride(3);

    prefixkv::attention::PagedDecode attention{};
    attention.q = reinterpret_cast<const uint16_t*>(qk);
    attention.q_row_stride = qk_size;
    attention.batch = rows;
    attention.heads = heads_;
    attention.kv_stride = kv_stride;
    attention.head_stride = head_stride;
    attention.slot_stride = slot_stride;
    attention.kv_heads = kv_heads_;
    attention.table = table.data_ptr<int64_t>();
    attention.max_pages = table.size(1);
    attention.lens = lens.data_ptr<int64_t>();
    attention.page_size = page_size;
    attention.scale = static_cast<float>(scale);
    attention.out = attended;
    attention.lse = lse;
    attention.head_dim = d;

    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      bf16* kv_layer = pool + static_cast<int64_t>(i) * layer_stride;
      // attention
      const bf16* in_norm = layer.input_norm.data_ptr<bf16>();
      each_row(rows, [&](int64_t r) {
        ops::rms_norm_row(hp + r * hidden_, in_norm, normed + r * hidden_, hidden_, eps_);
      });
      matmul(layer.qkv, normed, rows, layer.qkv_bias, qkv, xsum);
      each_row(rows, [&](int64_t r) {
        const bf16* row = qkv + r * qkv_size;
        const bf16* unrotated = row;
        if (layer.q_norm.has_value()) {  // as Attention.forward: each q head, then each k head, normed as a row
          bf16* out = head_normed + r * qk_size;
          const bf16 *qn = layer.q_norm->data_ptr<bf16>(), *kn = layer.k_norm->data_ptr<bf16>();
          for (int64_t j = 0; j < heads_ + kv_heads_; ++j)
            ops::rms_norm_row(row + j * d, j < heads_ ? qn : kn, out + j * d, d, eps_);
          unrotated = out;
        }
        bf16* rotated = qk + r * qk_size;
        ops::rotary_row(unrotated, heads_ + kv_heads_, d, cp + r * cs_stride, sp + r * cs_stride, rotated, d);
        for (int64_t j = 0; j < kv_heads_; ++j) {  // the pool write: rotated K, then V
          bf16* slot = kv_layer + j * head_stride + slots[r] * slot_stride;
          std::memcpy(slot, rotated + (heads_ + j) * d, d * sizeof(bf16));
          std::memcpy(slot + kv_stride, row + qk_size + j * d, d * sizeof(bf16));
        }
      });
      attention.kv = reinterpret_cast<const uint16_t*>(kv_layer);
      prefixkv::attention::paged_decode(attention, isa);
      matmul(layer.o, attended, rows, c10::nullopt, projected, xsum);
      each_row(rows, [&](int64_t r) { ops::add_row(hp + r * hidden_, projected + r * hidden_, hidden_); });
      // MLP
      const bf16* post_norm = layer.post_norm.data_ptr<bf16>();
      each_row(rows, [&](int64_t r) {
        ops::rms_norm_row(hp + r * hidden_, post_norm, normed + r * hidden_, hidden_, eps_);
      });
      matmul(layer.gate_up, normed, rows, c10::nullopt, gate_up, xsum);
      each_row(rows, [&](int64_t r) {
        const bf16* row = gate_up + r * 2 * intermediate_;
        ops::silu_mul_row(row, row + intermediate_, act + r * intermediate_, intermediate_);
      });
      matmul(layer.down, act, rows, c10::nullopt, projected, xsum);
      each_row(rows, [&](int64_t r) { ops::add_row(hp + r * hidden_, projected + r * hidden_, hidden_); });
    }
    return h;
  }

 private:
  void check(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
             const at::Tensor& slot_mapping, const at::Tensor& table, const at::Tensor& lens, int64_t page_size,
             int64_t isa) const {
    const int64_t rows = h.size(0);
    TORCH_CHECK(isa == 0 || isa == 2 || (isa == 1 && has_amx()),
                "DecodeLayers: isa must be 0 (AVX-512), 1 (AMX, where the CPU offers it) or 2 (emulated AMX)");
    TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.size(1) == hidden_ &&
                    h.is_contiguous(),
                "DecodeLayers: h must be contiguous bf16 [B, ", hidden_, "]");
    for (const at::Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == rows && t->size(2) == head_dim_ &&
                      t->stride(2) == 1,
                  "DecodeLayers: cos / sin must be bf16 [B, 1, ", head_dim_, "]");
    TORCH_CHECK(sin.stride(0) == cos.stride(0), "DecodeLayers: cos and sin must share a layout");
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16 && kv_cache.dim() == 5 &&
                    kv_cache.size(0) == static_cast<int64_t>(layers_.size()) && kv_cache.size(1) == 2 &&
                    kv_cache.size(2) == kv_heads_ && kv_cache.size(4) == head_dim_ && kv_cache.stride(4) == 1,
                "DecodeLayers: kv_cache must be bf16 [layers, 2, kv_heads, slots, head_dim], one pool layer per layer");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == rows,
                "DecodeLayers: slot_mapping must be int64 [B]");
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(slots[r] >= 0 && slots[r] < kv_cache.size(3), "DecodeLayers: slot ", slots[r], " is not in the pool");
    prefixkv::attention::check_pages(table, lens, rows, page_size, "DecodeLayers");
  }

  // y [rows, w.n] = x [rows, w.k] . w^T (+ bias); xsum: q4_1's scratch
  void matmul(const Weight& w, const bf16* x, int64_t rows, const c10::optional<at::Tensor>& bias, bf16* y,
              float* xsum) const {
    const auto* bias_ptr = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<bf16>()) : nullptr;
    const gemm::Problem out{reinterpret_cast<const uint16_t*>(x),
                            w.k,
                            w.format ? nullptr : reinterpret_cast<const uint16_t*>(w.packed.data_ptr<int16_t>()),
                            w.k / 2,
                            rows,
                            w.n,
                            bias_ptr,
                            reinterpret_cast<uint16_t*>(y),
                            w.n};
    if (!w.format) {
      amx_ ? gemm::run_amx(out) : gemm::run(out);
      return;
    }
    qgemm::Problem pb{};
    pb.x = out.x;
    pb.lda = w.k;
    pb.w = w.packed.data_ptr<uint8_t>();
    pb.blocks = w.k / qgemm::kBlock;
    pb.panel_bytes = pb.blocks * qgemm::panel_block_bytes(*w.format);
    pb.m = rows;
    pb.out = gemm::Problem{nullptr, 0, nullptr, 0, rows, w.n, bias_ptr, out.y, w.n};
    qgemm::run_format(*w.format, pb, xsum);
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, hidden_, intermediate_;
  float eps_;
  bool amx_;
};

void bind_decode_layers(py::module_& m) {
  // module_local: two builds (two checkouts' kernels, an A/B) can be loaded in one process
  py::class_<DecodeLayers>(m, "DecodeLayers", "the decoder layers of a decode-only step in one call",
                           py::module_local())
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                    const std::vector<c10::optional<at::Tensor>>&, const std::vector<c10::optional<at::Tensor>>&,
                    const std::vector<c10::optional<at::Tensor>>&, const std::vector<at::Tensor>&,
                    const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                    const std::vector<std::vector<std::string>>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                    double, bool>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("o"), py::arg("post_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("formats"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"), py::arg("eps"), py::arg("amx"))
      .def("run", &DecodeLayers::run, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::arg("table"), py::arg("lens"), py::arg("page_size"), py::arg("scale"),
           py::arg("isa"));
}
