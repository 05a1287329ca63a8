// The elementwise kernels' AVX2 + FMA rows (8 floats a vector): AMD EPYC Zen 3 and older, Intel Haswell ..; the
// "avx2" variant of native.py builds them on any CPU for the tests. The same operations, in the same order per
// element, as avx512.h; only RMSNorm's sum of squares adds 8 lanes where that adds 16 (both differ from torch's
// order alike: see test_fused_ops.py). Part of fused_ops.cpp's translation unit.
#pragma once

namespace prefixkv::ops {

namespace {

inline __m256 load8(const bf16* p) { return prefixkv::load8(reinterpret_cast<const uint16_t*>(p)); }

// the 8 lanes' sum, in a fixed tree
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

void rms_norm_row(const bf16* x, const bf16* weight, bf16* out, int64_t dim, float eps) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8) {
    const __m256 v = load8(x + i);
    sum = _mm256_fmadd_ps(v, v, sum);
  }
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(reduce_add8(sum) / dim + eps));
  for (int64_t i = 0; i < dim; i += 8)
    store8(out + i, _mm256_mul_ps(round_bf16_8(_mm256_mul_ps(load8(x + i), r)), load8(weight + i)));
}

void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t inter) {
  for (int64_t i = 0; i < inter; i += 8) {
    const __m256 x = load8(gate + i);
    const __m256 exp_neg = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp_neg));
    store8(out + i, _mm256_mul_ps(round_bf16_8(silu), load8(up + i)));
  }
}

void rotary_row(const bf16* x, int64_t heads, int64_t head_stride, const bf16* cos, const bf16* sin, bf16* out,
                int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const bf16* xh = x + h * head_stride;
    bf16* oh = out + h * dim;
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 a = load8(xh + i), b = load8(xh + half + i);
      // torch rounds x * cos, rotate_half(x) * sin and their sum to bf16 one by one: so do we
      const __m256 lo = _mm256_sub_ps(round_bf16_8(_mm256_mul_ps(a, load8(cos + i))),
                                      round_bf16_8(_mm256_mul_ps(b, load8(sin + i))));
      const __m256 hi = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(b, load8(cos + half + i))),
                                      round_bf16_8(_mm256_mul_ps(a, load8(sin + half + i))));
      store8(oh + i, lo);
      store8(oh + half + i, hi);
    }
  }
}

void add_row(bf16* h, const bf16* y, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 8) store8(h + i, _mm256_add_ps(load8(h + i), load8(y + i)));
}

}  // namespace prefixkv::ops
