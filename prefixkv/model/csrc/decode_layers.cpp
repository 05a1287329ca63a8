// The decoder layers of a decode-only step in one call (LlamaModel's fused decode path, model/llama.py).
//
// A decode step of one stream reads every weight once and computes little else, so the Python around each kernel
// (module calls, views, argument checks: ~12 kernels a layer) is a visible share of it. This loop calls the same
// kernels in the same order with the same arguments as the Python layers do (rms_norm, the row-invariant gemm,
// rotary, the pool write, paged_flash_decode, silu_mul, the residual adds), so its results are the Python path's,
// bit for bit; only the interpreter between them is gone. It covers what the fused decode path runs: every row a
// single-token decode attended in place with the cache-invariant kernel, fused ops, a row-invariant matmul, no
// per-head q/k norms.
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
std::vector<at::Tensor> paged_flash_decode(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                           int64_t page_size, double scale, c10::optional<at::Tensor> state_in,
                                           bool return_state, int64_t isa);
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor qgemm(at::Tensor x, at::Tensor packed, int64_t n, std::string format, c10::optional<at::Tensor> bias);

namespace {

// A packed matmul weight: bf16 panels (format "") or GGUF blocks (format "q8_0", "q4_0", "q4_1": qgemm)
struct Weight {
  at::Tensor packed;
  std::string format;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // the norms' weights
  Weight qkv, o, gate_up, down;
  c10::optional<at::Tensor> qkv_bias;
};

}  // namespace

class DecodeLayers {
 public:
  // Per layer, in order: input norm weight, packed q/k/v (fused), q/k/v bias or None, packed o, post-attention
  // norm weight, packed gate/up (fused), packed down; formats: per layer, the block formats of q/k/v, o, gate/up
  // and down ("" for bf16 panels). amx: the bf16 matmuls run amx_gemm (else gemm).
  DecodeLayers(const std::vector<at::Tensor>& input_norm, const std::vector<at::Tensor>& qkv,
               const std::vector<c10::optional<at::Tensor>>& qkv_bias, const std::vector<at::Tensor>& o,
               const std::vector<at::Tensor>& post_norm, const std::vector<at::Tensor>& gate_up,
               const std::vector<at::Tensor>& down, const std::vector<std::vector<std::string>>& formats,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
               bool amx)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), hidden_(hidden), intermediate_(intermediate),
        eps_(eps), amx_(amx) {
    const size_t n = input_norm.size();
    TORCH_CHECK(qkv.size() == n && qkv_bias.size() == n && o.size() == n && post_norm.size() == n &&
                    gate_up.size() == n && down.size() == n && formats.size() == n,
                "DecodeLayers: one of each weight per layer");
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(formats[i].size() == 4, "DecodeLayers: four formats per layer (q/k/v, o, gate/up, down)");
      layers_.push_back({input_norm[i], post_norm[i], {qkv[i], formats[i][0]}, {o[i], formats[i][1]},
                         {gate_up[i], formats[i][2]}, {down[i], formats[i][3]}, qkv_bias[i]});
    }
  }

  // h [B, hidden] bf16, one row per decode (updated in place and returned); cos/sin the rows' rotary tables;
  // kv_cache [layers, 2, kv_heads, slots, head_dim]; slot_mapping [B] where each row's K/V go; table / lens the
  // rows' page tables and context lengths (paged_flash_decode's)
  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, const at::Tensor& table, const at::Tensor& lens, int64_t page_size,
                 double scale, int64_t isa) const {
    TORCH_CHECK(kv_cache.size(0) == static_cast<int64_t>(layers_.size()), "DecodeLayers: one pool layer per layer");
    const int64_t rows = h.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const at::Tensor kv_layer = kv_cache.select(0, static_cast<int64_t>(i));
      // attention
      at::Tensor qkv = matmul(rms_norm(h, layer.input_norm, eps_), layer.qkv, q_size + 2 * kv_size, layer.qkv_bias);
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads_, head_dim_});
      at::Tensor qk = rotary(qkv.narrow(1, 0, q_size + kv_size).view({rows, -1, head_dim_}), cos, sin);
      at::Tensor q = qk.narrow(1, 0, heads_), k = qk.narrow(1, heads_, kv_heads_);
      at::Tensor kv = at::stack({k, v}, 1);  // [B, 2, KVH, d]
      kv_layer.index_copy_(2, slot_mapping, kv.permute({1, 2, 0, 3}));
      at::Tensor attended =
          paged_flash_decode(q, kv_layer, table, lens, page_size, scale, c10::nullopt, false, isa)[0];
      h.add_(matmul(attended.reshape({rows, q_size}), layer.o, hidden_, c10::nullopt));
      // MLP
      at::Tensor gate_up = matmul(rms_norm(h, layer.post_norm, eps_), layer.gate_up, 2 * intermediate_, c10::nullopt);
      h.add_(matmul(silu_mul(gate_up), layer.down, hidden_, c10::nullopt));
    }
    return h;
  }

 private:
  at::Tensor matmul(const at::Tensor& x, const Weight& w, int64_t n, const c10::optional<at::Tensor>& bias) const {
    if (!w.format.empty()) return qgemm(x, w.packed, n, w.format, bias);
    return amx_ ? amx_gemm(x, w.packed, n, bias) : gemm(x, w.packed, n, bias);
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, hidden_, intermediate_;
  double eps_;
  bool amx_;
};

void bind_decode_layers(py::module_& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers", "the decoder layers of a decode-only step in one call")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                    const std::vector<c10::optional<at::Tensor>>&, const std::vector<at::Tensor>&,
                    const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                    const std::vector<std::vector<std::string>>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                    double, bool>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("post_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("formats"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("hidden"), py::arg("intermediate"), py::arg("eps"), py::arg("amx"))
      .def("run", &DecodeLayers::run, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::arg("table"), py::arg("lens"), py::arg("page_size"), py::arg("scale"),
           py::arg("isa"));
}
