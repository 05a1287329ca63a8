// One-pass bf16 versions of the elementwise parts of a decoder layer: the driver (checks, rows over threads, the
// tensor entry points); the rows themselves are one file per ISA, `avx512.h` (AVX-512F) or `avx2.h` (AVX2 + FMA),
// included here under that ISA's #if.
//
// Why: in a 2048-token bf16 prefill step, torch runs SiLU-and-multiply, RMSNorm and the rotary embedding as
// 3-6 separate passes each (with float32 round trips in between), ~30% of the step. Each function here reads its
// input once and writes its output once, computing in float32 and rounding to bf16 wherever torch's bf16 ops
// round (SiLU before the multiply, the normalised row before the weight, each product of the rotary embedding),
// so the results equal torch's bit for bit but where a float32 sum's order differs (tested). float32 models never
// come here: they keep torch's ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>

#include "../fused_ops.h"
#include "../simd.h"

#if defined(__AVX512F__)
#define PREFIXKV_FUSED_ISA "avx512"
#include "avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define PREFIXKV_FUSED_ISA "avx2"
#include "avx2.h"
#endif

namespace {

void check_bf16_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, ": expected a bfloat16 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

}  // namespace

#ifdef PREFIXKV_FUSED_ISA
using namespace prefixkv::ops;

// gate_up [T, 2I] (rows may be strided) -> [T, I]: bf16(silu(gate)) * up
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_bf16_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 32 == 0, "silu_mul: expected [T, 2I] with I % 16 == 0");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inter}, gate_up.options());
  const auto* in = gate_up.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(in + t * stride, in + t * stride + inter, o + t * inter, inter);
  });
  return out;
}

// x [T, D] -> [T, D]: bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), sums in float32
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16_rows(x, "rms_norm");
  check_bf16_rows(weight, "rms_norm weight");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 16 == 0 && weight.numel() == x.size(1), "rms_norm: expected [T, D]");
  const int64_t rows = x.size(0), dim = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows, dim}, x.options());
  const auto* in = x.data_ptr<c10::BFloat16>();
  const auto* w = weight.contiguous().data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(in + t * stride, w, o + t * dim, dim, epsf);
  });
  return out;
}

// x [T, H, d] (strided rows and heads), cos/sin [T, 1, d] -> [T, H, d]: x * cos + rotate_half(x) * sin
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_bf16_rows(x, "rotary");
  check_bf16_rows(cos, "rotary cos");
  check_bf16_rows(sin, "rotary sin");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 32 == 0, "rotary: expected [T, H, d] with d % 32 == 0");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  TORCH_CHECK(cos.size(0) == rows && cos.size(-1) == dim && sin.sizes() == cos.sizes(), "rotary: cos/sin shape");
  const int64_t cs_stride = cos.stride(0);
  TORCH_CHECK(sin.stride(0) == cs_stride, "rotary: cos and sin must share a layout");
  auto out = at::empty({rows, heads, dim}, x.options());
  const auto* in = x.data_ptr<c10::BFloat16>();
  const auto* c = cos.data_ptr<c10::BFloat16>();
  const auto* s = sin.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cs = t * cs_stride;
      rotary_row(in + t * row_stride, heads, head_stride, c + cs, s + cs, o + t * heads * dim, dim);
    }
  });
  return out;
}
#else
namespace {
constexpr const char* kNoRows = "the fused elementwise kernels need AVX-512 or AVX2 + FMA (not compiled in)";
}
namespace prefixkv::ops {
void rms_norm_row(const bf16*, const bf16*, bf16*, int64_t, float) { TORCH_CHECK(false, kNoRows); }
void silu_mul_row(const bf16*, const bf16*, bf16*, int64_t) { TORCH_CHECK(false, kNoRows); }
void rotary_row(const bf16*, int64_t, int64_t, const bf16*, const bf16*, bf16*, int64_t) {
  TORCH_CHECK(false, kNoRows);
}
void add_row(bf16*, const bf16*, int64_t) { TORCH_CHECK(false, kNoRows); }
}  // namespace prefixkv::ops

at::Tensor silu_mul(const at::Tensor&) { TORCH_CHECK(false, kNoRows); }
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { TORCH_CHECK(false, kNoRows); }
at::Tensor rotary(const at::Tensor&, const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, kNoRows); }
#endif

// which ISA's rows are compiled in: "avx512", "avx2", or "" (none: the Python side keeps torch's ops)
std::string fused_ops_isa() {
#ifdef PREFIXKV_FUSED_ISA
  return PREFIXKV_FUSED_ISA;
#else
  return "";
#endif
}

bool has_fused_ops() { return !fused_ops_isa().empty(); }
