// Decode attention read straight from the paged KV pool, for CPU: one query token per sequence.
//
// Why: without it every decode step first gathers each sequence's K/V slots into a padded batch (a copy of all of
// them) and then runs a batched SDPA whose per-(sequence, head) work is tiny. Decode is memory-bound, so reading
// the pool once in place is what matters. Work is split over (sequence, kv head); each item computes the scores
// of the kv head's query rows against its slots, a softmax in float32, then the weighted sum of values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kMaxHeadDim = 256;

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return prefixkv::bf16_to_float(x.x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

#if defined(__AVX512F__)
using prefixkv::load16;

// scores[g * len + t] for one kv head of one sequence, head_dim = 64 (4 vectors), `group` query rows
template <typename T>
void scores_dim64(const float* qf, int64_t group, const T* k_base, int64_t slot_stride, const int64_t* pages,
                  int64_t page_size, int64_t len, float* scores) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = pages[t / page_size] * page_size + t % page_size;
    const T* k = k_base + slot * slot_stride;
    const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = qf + g * 64;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), k0);
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), k1, acc);
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), k2, acc);
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), k3, acc);
      scores[g * len + t] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <typename T>
void values_dim64(const float* probs, int64_t group, const T* v_base, int64_t slot_stride, const int64_t* pages,
                  int64_t page_size, int64_t len, float* acc) {
  __m512 a[64][4];
  for (int64_t g = 0; g < group; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = pages[t / page_size] * page_size + t % page_size;
    const T* v = v_base + slot * slot_stride;
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * len + t]);
      a[g][0] = _mm512_fmadd_ps(p, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(p, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(p, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(p, v3, a[g][3]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g * 64 + 16 * j, a[g][j]);
}
#endif

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table, const at::Tensor& lens,
            int64_t page_size, float scale, at::Tensor& out, float* lse_ptr) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv.size(1), group = heads / kv_heads, max_pages = table.size(1);
  const int64_t kv_stride = kv.stride(0), head_stride = kv.stride(1), slot_stride = kv.stride(2);
  const T* q_ptr = q.data_ptr<T>();
  const T* kv_ptr = kv.data_ptr<T>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores;
    float row[kMaxHeadDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, len = len_ptr[b];
      const int64_t* pages = table_ptr + b * max_pages;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + (b * heads + h * group + g) * dim, qf.data() + g * dim, dim);
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] *= scale;
      }
      const T* k_base = kv_ptr + h * head_stride;
      const T* v_base = kv_ptr + kv_stride + h * head_stride;

#if defined(__AVX512F__)
      const bool vector_path = dim == 64;
#else
      const bool vector_path = false;
#endif
      if (vector_path) {
#if defined(__AVX512F__)
        scores_dim64(qf.data(), group, k_base, slot_stride, pages, page_size, len, scores.data());
#endif
      } else {
        for (int64_t t = 0; t < len; ++t) {  // scores of every query row of this kv head
          const int64_t slot = pages[t / page_size] * page_size + t % page_size;
          load_row(k_base + slot * slot_stride, row, dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
            scores[g * len + t] = s;
          }
        }
      }
      float inv_sum[64];
      for (int64_t g = 0; g < group; ++g) {  // softmax in float32
        float* s = scores.data() + g * len;
        const float m = *std::max_element(s, s + len);
        float* lse = lse_ptr == nullptr ? nullptr : lse_ptr + b * heads + h * group + g;
        float sum = 0.f;
        int64_t t = 0;
#if defined(__AVX512F__)
        __m512 vsum = _mm512_setzero_ps();
        const __m512 vm = _mm512_set1_ps(m);
        for (; t + 16 <= len; t += 16) {
          const __m512 e = prefixkv::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
          _mm512_storeu_ps(s + t, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        sum = _mm512_reduce_add_ps(vsum);
#endif
        for (; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[g] = 1.f / sum;
        if (lse != nullptr) *lse = m + std::log(sum);  // the scores were scaled: natural log-sum-exp
      }
      if (vector_path) {
#if defined(__AVX512F__)
        values_dim64(scores.data(), group, v_base, slot_stride, pages, page_size, len, acc.data());
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {  // weighted sum of values
          const int64_t slot = pages[t / page_size] * page_size + t % page_size;
          load_row(v_base + slot * slot_stride, row, dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_ptr + (b * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv_sum[g]);
      }
    }
  });
}

}  // namespace

namespace {

at::Tensor decode_into(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens, int64_t page_size,
                       double scale, float* lse) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && kv.size(0) == 2, "expected q [B, H, D] and kv [2, KVH, slots, D]");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv must have one dtype");
  TORCH_CHECK(q.size(2) == kv.size(3) && q.size(2) <= kMaxHeadDim && kv.stride(3) == 1, "bad head_dim or layout");
  TORCH_CHECK(q.size(1) % kv.size(1) == 0 && q.size(1) / kv.size(1) <= 64, "bad head grouping");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "table/lens must be int64");
  TORCH_CHECK(table.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table row and length per sequence");
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: decode<float>(q, kv, table, lens, page_size, s, out, lse); break;
    case at::kBFloat16: decode<c10::BFloat16>(q, kv, table, lens, page_size, s, out, lse); break;
    case at::kHalf: decode<c10::Half>(q, kv, table, lens, page_size, s, out, lse); break;
    default: TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
  return out;
}

}  // namespace

// q [B, H, D]; kv [2, KVH, slots, D] (one layer of the pool, D contiguous); table [B, max_pages] int64 page ids;
// lens [B] int64 context lengths (positions [0, len) are attended, every len >= 1). Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                     int64_t page_size, double scale) {
  return decode_into(q.contiguous(), kv, table.contiguous(), lens.contiguous(), page_size, scale, nullptr);
}

// The same, also returning each row's log-sum-exp [B, H] float32 (to merge with attention over other keys).
std::vector<at::Tensor> paged_decode_attention_lse(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                                   int64_t page_size, double scale) {
  q = q.contiguous();
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  auto out = decode_into(q, kv, table.contiguous(), lens.contiguous(), page_size, scale, lse.data_ptr<float>());
  return {out, lse};
}
