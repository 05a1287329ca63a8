// One-pass bf16 versions of the elementwise parts of a decoder layer, for CPU with AVX-512.
//
// Why: in a 2048-token bf16 prefill step, torch runs SiLU-and-multiply, RMSNorm and the rotary embedding as
// 3-6 separate passes each (with float32 round trips in between), ~30% of the step. Each function here reads its
// input once and writes its output once, computing in float32 and rounding to bf16 wherever torch's bf16 ops
// round (SiLU before the multiply, the normalised row before the weight, each product of the rotary embedding),
// so the results equal torch's bit for bit (tested). float32 models never come here: they keep torch's ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "fused_ops.h"
#include "simd.h"

namespace {

void check_bf16_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, ": expected a bfloat16 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

}  // namespace

#if defined(__AVX512F__)
using prefixkv::exp16;
using prefixkv::load16;
using prefixkv::round_bf16;
using prefixkv::store16;

namespace prefixkv::ops {

void rms_norm_row(const bf16* x, const bf16* weight, bf16* out, int64_t dim, float eps) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = load16(x + i);
    sum = _mm512_fmadd_ps(v, v, sum);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sum) / dim + eps));
  for (int64_t i = 0; i < dim; i += 16)
    store16(out + i, _mm512_mul_ps(round_bf16(_mm512_mul_ps(load16(x + i), r)), load16(weight + i)));
}

void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t inter) {
  for (int64_t i = 0; i < inter; i += 16) {
    const __m512 x = load16(gate + i);
    const __m512 exp_neg = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp_neg));
    store16(out + i, _mm512_mul_ps(round_bf16(silu), load16(up + i)));
  }
}

void rotary_row(const bf16* x, int64_t heads, int64_t head_stride, const bf16* cos, const bf16* sin, bf16* out,
                int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const bf16* xh = x + h * head_stride;
    bf16* oh = out + h * dim;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 a = load16(xh + i), b = load16(xh + half + i);
      // torch rounds x * cos, rotate_half(x) * sin and their sum to bf16 one by one: so do we
      const __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(a, load16(cos + i))),
                                      round_bf16(_mm512_mul_ps(b, load16(sin + i))));
      const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, load16(cos + half + i))),
                                      round_bf16(_mm512_mul_ps(a, load16(sin + half + i))));
      store16(oh + i, lo);
      store16(oh + half + i, hi);
    }
  }
}

void add_row(bf16* h, const bf16* y, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) store16(h + i, _mm512_add_ps(load16(h + i), load16(y + i)));
}

}  // namespace prefixkv::ops

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
namespace prefixkv::ops {
void rms_norm_row(const bf16*, const bf16*, bf16*, int64_t, float) { TORCH_CHECK(false, "rms_norm needs AVX-512"); }
void silu_mul_row(const bf16*, const bf16*, bf16*, int64_t) { TORCH_CHECK(false, "silu_mul needs AVX-512"); }
void rotary_row(const bf16*, int64_t, int64_t, const bf16*, const bf16*, bf16*, int64_t) {
  TORCH_CHECK(false, "rotary needs AVX-512");
}
void add_row(bf16*, const bf16*, int64_t) { TORCH_CHECK(false, "add_row needs AVX-512"); }
}  // namespace prefixkv::ops

at::Tensor silu_mul(const at::Tensor&) { TORCH_CHECK(false, "silu_mul needs AVX-512"); }
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { TORCH_CHECK(false, "rms_norm needs AVX-512"); }
at::Tensor rotary(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "rotary needs AVX-512");
}
#endif

// whether the functions above are compiled in (the Python side asks before choosing them)
bool has_fused_ops() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
