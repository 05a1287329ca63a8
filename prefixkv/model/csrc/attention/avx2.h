// The attention kernels' AVX2 + FMA path (isa 0 of a build without AVX-512 BF16: AMD EPYC Zen 3 and older, and
// Intel CPUs with AVX-512 but no AVX512_BF16; the "avx2" variant of native.py builds it on any CPU for the tests).
// No bf16 dot product, so K, V and the queries are widened to float32 (exactly) when they are packed, and each
// product is one FMA. K is packed [8-key group][64 dims][8 keys] (a vector holds one dim of 8 keys), V [key][64
// dims] (a key's values, 8 vectors). A score is one
// chain of FMAs over the dims in order 0, 1, ..., 63 from zero; an output dim is one chain over the keys in order,
// from the row's state. Probabilities stay float32 (nothing here reads bf16 pairs), and a row's sum adds the
// chunk's vectors in order, then the lanes in a fixed tree. A tile is 2 rows: their 8 score or output chains, 4 K
// or V vectors and 2 broadcasts fit the 16 ymm registers. The bits differ from the AVX512_BF16 path's; within
// one build every row is computed alike, whatever its tile, chunking or caller.
// Part of flash_attention.cpp's translation unit.
#pragma once

namespace {

constexpr at::ScalarType kPackedType = at::kFloat;  // Packed's storage
constexpr bool kFloatQueries = true;  // Rows::qf
constexpr int64_t kTile = 2;          // query rows computed together
constexpr int64_t kLanes = 8;         // floats per vector
constexpr int64_t kVecsPerChunk = kChunk / kLanes;

using prefixkv::load8;

// K [L, 64] of one kv head -> the two 8-key groups of 16-key group `group` ([64 dims][8 keys] each)
void pack_keys(const uint16_t* k_base, int64_t slot_stride, const int64_t* slots, int64_t length, int64_t group,
               float* out) {
  for (int64_t i = 0; i < kKeysPerVec; ++i) {
    const int64_t key = group * kKeysPerVec + i;
    float* column = out + key / kLanes * kDim * kLanes + key % kLanes;
    const uint16_t* src = key < length ? k_base + slots[key] * slot_stride : nullptr;
    for (int64_t d = 0; d < kDim; ++d) column[d * kLanes] = src != nullptr ? bf16_to_float(src[d]) : 0.f;
  }
}

// V [L, 64] of one kv head -> keys 2 pair and 2 pair + 1 as rows of 64 floats (zeros past the length)
void pack_values(const uint16_t* v_base, int64_t slot_stride, const int64_t* slots, int64_t length, int64_t pair,
                 float* out) {
  for (int64_t key = 2 * pair; key < 2 * pair + 2; ++key) {
    const uint16_t* src = key < length ? v_base + slots[key] * slot_stride : nullptr;
    for (int64_t d = 0; d < kDim; d += kLanes)
      _mm256_storeu_ps(out + key * kDim + d, src != nullptr ? load8(src + d) : _mm256_setzero_ps());
  }
}

// 8 x 8 floats: r[j] lane i = r[i] lane j before
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {  // u[4k + c], 128-bit half h: lane 4h + c of rows 4k .. 4k + 3
    u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// Keys [c0, c0 + 16 * nvec) of one sequence -> the pack_keys layout of one chunk (keys >= len are zero); slots:
// those of keys [c0, len) from chunk_slots
void pack_chunk_keys(const uint16_t* k_base, int64_t slot_stride, const int64_t* slots, int64_t c0, int64_t len,
                     int64_t nvec, float* out) {
  for (int64_t g = 0; g < nvec * kKeysPerVec / kLanes; ++g) {
    const uint16_t* src[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t key = g * kLanes + i;  // within the chunk
      src[i] = c0 + key < len ? k_base + slots[key] * slot_stride : nullptr;
    }
    for (int64_t d0 = 0; d0 < kDim; d0 += kLanes) {
      __m256 r[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) r[i] = src[i] != nullptr ? load8(src[i] + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t d = 0; d < kLanes; ++d) _mm256_store_ps(out + (g * kDim + d0 + d) * kLanes, r[d]);
    }
  }
}

// Key pairs [c0 / 2, c0 / 2 + pairs) of one sequence -> the pack_values layout of one chunk; slots as for
// pack_chunk_keys
void pack_chunk_values(const uint16_t* v_base, int64_t slot_stride, const int64_t* slots, int64_t c0, int64_t len,
                       int64_t pairs, float* out) {
  for (int64_t key = 0; key < 2 * pairs; ++key) {  // within the chunk
    const uint16_t* src = c0 + key < len ? v_base + slots[key] * slot_stride : nullptr;
    for (int64_t d = 0; d < kDim; d += kLanes)
      _mm256_store_ps(out + key * kDim + d, src != nullptr ? load8(src + d) : _mm256_setzero_ps());
  }
}

// the lanes' max and sum, each in one fixed order
inline float max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Row r's output (normalised, bf16), log-sum-exp and, when state is set, its raw state
__attribute__((noinline)) void finish_row(const Rows& rows, int64_t r, c10::BFloat16* out, float* lse, float* state) {
  const __m256 inv = _mm256_set1_ps(1.f / rows.l[r]);
  for (int64_t d = 0; d < kDim; d += kLanes)
    prefixkv::store8(out + d, _mm256_mul_ps(inv, _mm256_load_ps(rows.o + r * kDim + d)));
  *lse = rows.m[r] + std::log(rows.l[r]);
  if (state != nullptr) {
    std::memcpy(state, rows.o + r * kDim, sizeof(float) * kDim);
    state[kDim] = rows.m[r];
    state[kDim + 1] = rows.l[r];
  }
}

// Row r's scores s[0..nvec) of the chunk from key c0 (8 keys each, not yet scaled): scale, mask, online softmax;
// probabilities in key order -> probs (8 * nvec of them); the row's max, sum and output rescaled
inline void softmax_row(const Rows& rows, int64_t r, int64_t c0, int64_t nvec, __m256* s, float* probs,
                        float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256 vscale = _mm256_set1_ps(scale), vneg = _mm256_set1_ps(neg_inf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const bool all_visible = c0 + kLanes * nvec - 1 <= rows.see[r];  // most of a prefill
  const __m256i past_seen = _mm256_set1_epi32(static_cast<int>(rows.see[r] + 1));
  __m256 visible[kVecsPerChunk];
  __m256 vmax = vneg;
  for (int64_t j = 0; j < nvec; ++j) {
    s[j] = _mm256_mul_ps(s[j], vscale);
    if (!all_visible) {
      const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(c0 + kLanes * j)));
      visible[j] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(past_seen, key));  // key <= see
      s[j] = _mm256_blendv_ps(vneg, s[j], visible[j]);
    }
    vmax = _mm256_max_ps(vmax, s[j]);
  }
  const float chunk_max = max8(vmax);
  if (chunk_max == neg_inf) {  // nothing visible in this chunk for this row
    std::memset(probs, 0, sizeof(float) * kLanes * nvec);
    return;
  }
  const float m_new = std::max(rows.m[r], chunk_max);
  const float alpha = rows.m[r] == neg_inf ? 0.f : rows.m[r] == m_new ? 1.f : std::exp(rows.m[r] - m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < nvec; ++j) {
    __m256 e = prefixkv::exp8(_mm256_sub_ps(s[j], vm));
    if (!all_visible) e = _mm256_and_ps(e, visible[j]);  // exp8 clamps its argument: masked lanes zeroed here
    _mm256_store_ps(probs + kLanes * j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  rows.l[r] = rows.l[r] * alpha + sum8(vsum);
  rows.m[r] = m_new;
  if (alpha != 1.f) {
    const __m256 va = _mm256_set1_ps(alpha);
    float* orow = rows.o + r * kDim;
    for (int64_t d = 0; d < kDim; d += kLanes) _mm256_store_ps(orow + d, _mm256_mul_ps(va, _mm256_load_ps(orow + d)));
  }
}

// The scores of two query rows (float32, 64 dims each) against N 8-key groups of K from kc: 2N chains
template <int N>
inline void score_groups(const float* kc, const float* q0, const float* q1, __m256* s0, __m256* s1) {
  __m256 a[N], b[N];
  for (int j = 0; j < N; ++j) a[j] = b[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < kDim; ++d) {
    const __m256 x0 = _mm256_broadcast_ss(q0 + d), x1 = _mm256_broadcast_ss(q1 + d);
    for (int j = 0; j < N; ++j) {
      const __m256 k = _mm256_load_ps(kc + (j * kDim + d) * kLanes);
      a[j] = _mm256_fmadd_ps(x0, k, a[j]);
      b[j] = _mm256_fmadd_ps(x1, k, b[j]);
    }
  }
  for (int j = 0; j < N; ++j) {
    s0[j] = a[j];
    s1[j] = b[j];
  }
}

// Rows [t0, t0 + 2) against the kChunk keys from key c0, packed at kc (pack_keys layout, this chunk's groups)
// and vc (pack_values layout, this chunk's keys). Not inlined: both entry points run this one compiled copy, so
// a row's arithmetic cannot depend on its caller (the compiler may not contract or reorder it differently).
__attribute__((noinline)) void attend_chunk(const float* kc, const float* vc, int64_t c0, int64_t t0,
                                            const Rows& rows, float scale) {
  const int64_t tile_see = std::max(rows.see[t0], rows.see[t0 + 1]);
  if (tile_see < c0) return;
  const int64_t nvec = std::min<int64_t>(kVecsPerChunk, (tile_see - c0) / kLanes + 1);
  __m256 s[kTile][kVecsPerChunk];
  const float* q0 = rows.qf + t0 * kDim;
  const float* q1 = q0 + kDim;
  for (int64_t j0 = 0; j0 < nvec; j0 += 4) {  // 4 groups (32 keys) at a time
    const float* kj = kc + j0 * kDim * kLanes;
    switch (std::min<int64_t>(4, nvec - j0)) {
      case 4: score_groups<4>(kj, q0, q1, s[0] + j0, s[1] + j0); break;
      case 3: score_groups<3>(kj, q0, q1, s[0] + j0, s[1] + j0); break;
      case 2: score_groups<2>(kj, q0, q1, s[0] + j0, s[1] + j0); break;
      default: score_groups<1>(kj, q0, q1, s[0] + j0, s[1] + j0); break;
    }
  }
  alignas(32) float probs[kTile][kChunk];
  for (int64_t i = 0; i < kTile; ++i) softmax_row(rows, t0 + i, c0, nvec, s[i], probs[i], scale);
  // values: o += p @ V over this chunk's keys, 32 output dims (4 vectors per row) at a time
  const int64_t keys = nvec * kLanes;
  for (int64_t h = 0; h < kDim; h += 4 * kLanes) {
    float* o0 = rows.o + t0 * kDim + h;
    float* o1 = o0 + kDim;
    __m256 a[4], b[4];
    for (int v = 0; v < 4; ++v) {
      a[v] = _mm256_load_ps(o0 + v * kLanes);
      b[v] = _mm256_load_ps(o1 + v * kLanes);
    }
    for (int64_t k = 0; k < keys; ++k) {
      const __m256 p0 = _mm256_broadcast_ss(probs[0] + k), p1 = _mm256_broadcast_ss(probs[1] + k);
      const float* vk = vc + k * kDim + h;
      for (int v = 0; v < 4; ++v) {
        const __m256 x = _mm256_load_ps(vk + v * kLanes);
        a[v] = _mm256_fmadd_ps(p0, x, a[v]);
        b[v] = _mm256_fmadd_ps(p1, x, b[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      _mm256_store_ps(o0 + v * kLanes, a[v]);
      _mm256_store_ps(o1 + v * kLanes, b[v]);
    }
  }
}

}  // namespace
