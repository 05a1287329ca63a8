// The elementwise kernels' AVX-512 rows (16 floats a vector): any CPU with AVX-512F, AVX512_BF16 or not.
// Part of fused_ops.cpp's translation unit.
#pragma once

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
