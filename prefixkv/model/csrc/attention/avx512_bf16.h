// The attention kernels' AVX512_BF16 path (isa 0 of an AVX-512 BF16 build: AMD EPYC Zen 4 / 5, Intel Xeon since
// Cooper Lake): bf16 dot products (vdpbf16ps) for both products, float32 online softmax.
// Layout: K and V are packed into bf16 pairs (K: 16 keys x 2 dims per vector, so one dot-product instruction
// scores 16 keys; V: 2 keys x 16 dims, so one adds 2 keys' values into 16 output dims): once per call for
// flash_attention, chunk by chunk (in registers, then L1) for decodes. Probabilities are rounded to bfloat16 for
// the value product, and the row sums use the rounded values so the weights stay normalised. amx.h's tile
// kernels reuse this file's packing, softmax_row and finish_row. Part of flash_attention.cpp's translation unit.
#pragma once

namespace {

constexpr at::ScalarType kPackedType = at::kShort;  // Packed's storage
constexpr bool kFloatQueries = false;  // the dot products read the queries' bf16 pairs where they lie
constexpr int64_t kTile = 4;           // query rows computed together

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// K [L, 64] of one kv head -> Kp[group][pair][16 keys x 2]: one 64-byte vector per (group of 16 keys, pair)
void pack_keys(const uint16_t* k_base, int64_t slot_stride, const int64_t* slots, int64_t length, int64_t group,
               uint16_t* out) {
  uint16_t* dst = out + group * kPairs * 32;
  for (int64_t i = 0; i < kKeysPerVec; ++i) {
    const int64_t key = group * kKeysPerVec + i;
    if (key < length) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(k_base + slots[key] * slot_stride);
      for (int64_t p = 0; p < kPairs; ++p) reinterpret_cast<uint32_t*>(dst + p * 32)[i] = src[p];
    } else {
      for (int64_t p = 0; p < kPairs; ++p) reinterpret_cast<uint32_t*>(dst + p * 32)[i] = 0;
    }
  }
}

// V [L, 64] of one kv head -> Vp[key pair][4 vectors of 16 dims x 2 keys]
void pack_values(const uint16_t* v_base, int64_t slot_stride, const int64_t* slots, int64_t length, int64_t pair,
                 uint16_t* out) {
  uint16_t* dst = out + pair * 2 * kDim;
  const int64_t k0 = 2 * pair, k1 = 2 * pair + 1;
  const uint16_t* a = k0 < length ? v_base + slots[k0] * slot_stride : nullptr;
  const uint16_t* b = k1 < length ? v_base + slots[k1] * slot_stride : nullptr;
  for (int64_t d = 0; d < kDim; ++d) {
    dst[2 * d] = a ? a[d] : 0;
    dst[2 * d + 1] = b ? b[d] : 0;
  }
}

// 16 x 16 dwords: out[p] lane i = in[i] lane p (four rounds of in-lane unpacks and 128-bit shuffles)
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // b[4k + c], 128-bit lane L: dword 4L + c of rows 4k .. 4k + 3
    b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // 4 x 4 transpose of 128-bit lanes over b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512i y0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), y1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i y2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i y3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(y0, y2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(y1, y3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
  }
}

// Keys [c0, c0 + 16 * nvec) of one sequence -> the pack_keys layout of one chunk (keys >= len are zero); slots:
// those of keys [c0, len) from chunk_slots
void pack_chunk_keys(const uint16_t* k_base, int64_t slot_stride, const int64_t* slots, int64_t c0, int64_t len,
                     int64_t nvec, uint16_t* out) {
  for (int64_t j = 0; j < nvec; ++j) {
    const uint16_t* src[kKeysPerVec];
    for (int64_t i = 0; i < kKeysPerVec; ++i) {
      const int64_t key = j * kKeysPerVec + i;  // within the chunk
      src[i] = c0 + key < len ? k_base + slots[key] * slot_stride : nullptr;
    }
    for (int64_t b = 0; b < kPairs / 16; ++b) {  // pairs 16b .. 16b + 15 (dims 32b .. 32b + 31) of 16 keys
      __m512i r[16];
      for (int64_t i = 0; i < kKeysPerVec; ++i)
        r[i] = src[i] != nullptr ? _mm512_loadu_si512(src[i] + 32 * b) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(out + (j * kPairs + 16 * b + p) * 32, r[p]);
    }
  }
}

// Key pairs [c0 / 2, c0 / 2 + pairs) of one sequence -> the pack_values layout of one chunk; slots as for
// pack_chunk_keys
void pack_chunk_values(const uint16_t* v_base, int64_t slot_stride, const int64_t* slots, int64_t c0, int64_t len,
                       int64_t pairs, uint16_t* out) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const int64_t k0 = 2 * kp, k1 = k0 + 1;  // within the chunk
    const uint16_t* a = c0 + k0 < len ? v_base + slots[k0] * slot_stride : nullptr;
    const uint16_t* b = c0 + k1 < len ? v_base + slots[k1] * slot_stride : nullptr;
    uint16_t* dst = out + kp * 2 * kDim;
    for (int64_t d = 0; d < kDim; d += 32) {  // dims d .. d + 31 of keys k0, k1, interleaved
      const __m512i x = a != nullptr ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
      const __m512i y = b != nullptr ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_store_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, low, y));
      _mm512_store_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, high, y));
    }
  }
}

// Row r's output (normalised, bf16), log-sum-exp and, when state is set, its raw state
__attribute__((noinline)) void finish_row(const Rows& rows, int64_t r, c10::BFloat16* out, float* lse, float* state) {
  const __m512 inv = _mm512_set1_ps(1.f / rows.l[r]);
  for (int64_t d = 0; d < kDim; d += 16)
    prefixkv::store16(out + d, _mm512_mul_ps(inv, _mm512_load_ps(rows.o + r * kDim + d)));
  *lse = rows.m[r] + std::log(rows.l[r]);
  if (state != nullptr) {
    std::memcpy(state, rows.o + r * kDim, sizeof(float) * kDim);
    state[kDim] = rows.m[r];
    state[kDim + 1] = rows.l[r];
  }
}

// Row r's scores s[0..nvec) of the chunk from key c0 (dot products, not yet scaled): scale, mask, online
// softmax; probabilities -> bf16 pairs in key order (prob_pairs, 32 of them); the row's max, sum and output
// rescaled. Both the AVX-512 and the AMX chunk routines inline this one definition.
__attribute__((always_inline)) inline void softmax_row(const Rows& rows, int64_t r, int64_t c0, int64_t nvec,
                                                       __m512* s, uint32_t* prob_pairs, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i ones = _mm512_set1_epi16(0x3F80);  // bf16 1.0 pairs: a dot product with them sums a pair
  float* orow = rows.o + r * kDim;
  __m512 vmax = _mm512_set1_ps(neg_inf);
  __mmask16 visible[4];
  if (c0 + kKeysPerVec * nvec - 1 <= rows.see[r]) {  // every key of the chunk visible (most of a prefill)
    for (int64_t j = 0; j < nvec; ++j) {
      visible[j] = 0xFFFF;
      s[j] = _mm512_mul_ps(s[j], vscale);
      vmax = _mm512_max_ps(vmax, s[j]);
    }
  } else {
    for (int64_t j = 0; j < nvec; ++j) {
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0 + 16 * j)));
      visible[j] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(rows.see[r])));
      s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(neg_inf), visible[j], s[j], vscale);
      vmax = _mm512_max_ps(vmax, s[j]);
    }
  }
  const float chunk_max = _mm512_reduce_max_ps(vmax);
  if (chunk_max == neg_inf) {  // nothing visible in this chunk for this row
    for (int64_t j = 0; j < kChunk / 2; ++j) prob_pairs[j] = 0;
    return;
  }
  const float m_new = std::max(rows.m[r], chunk_max);
  const float alpha = rows.m[r] == neg_inf ? 0.f : rows.m[r] == m_new ? 1.f : std::exp(rows.m[r] - m_new);
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 e[4];
  for (int64_t j = 0; j < 4; ++j) {
    // exp16_bf16 clamps its argument, so masked lanes are zeroed explicitly
    e[j] = j < nvec ? _mm512_maskz_mov_ps(visible[j], prefixkv::exp16_bf16(_mm512_sub_ps(s[j], vm)))
                    : _mm512_setzero_ps();
  }
  // bf16 probabilities in key order are exactly the (key 2j, key 2j + 1) pairs the value product reads; their
  // sum (of the rounded values, so the weights stay normalised) is two dot products with ones
  const __m512bh p01 = _mm512_cvtne2ps_pbh(e[1], e[0]), p23 = _mm512_cvtne2ps_pbh(e[3], e[2]);
  _mm512_store_si512(prob_pairs, (__m512i)p01);
  _mm512_store_si512(prob_pairs + 16, (__m512i)p23);
  __m512 vsum = _mm512_dpbf16_ps(_mm512_setzero_ps(), p01, as_bh(ones));
  if (nvec > 2) vsum = _mm512_dpbf16_ps(vsum, p23, as_bh(ones));
  rows.l[r] = rows.l[r] * alpha + _mm512_reduce_add_ps(vsum);
  rows.m[r] = m_new;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < kDim; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(va, _mm512_load_ps(orow + d)));
  }
}

// Rows [t0, t0 + kTile) against the kChunk keys from key c0, packed at kc (pack_keys layout, this chunk's groups)
// and vc (pack_values layout, this chunk's pairs). Not inlined: both entry points run this one compiled copy, so
// a row's arithmetic cannot depend on its caller (the compiler may not contract or reorder it differently).
__attribute__((noinline)) void attend_chunk(const uint16_t* kc, const uint16_t* vc, int64_t c0, int64_t t0,
                                            const Rows& rows, float scale) {
  int64_t tile_see = 0;
  for (int64_t i = 0; i < kTile; ++i) tile_see = std::max(tile_see, rows.see[t0 + i]);
  if (tile_see < c0) return;
  alignas(64) uint32_t probs[kTile][kChunk / 2];
  const int64_t nvec = std::min<int64_t>(4, (tile_see - c0) / kKeysPerVec + 1);
  __m512 s[kTile][4];
  for (int64_t i = 0; i < kTile; ++i)
    for (int64_t j = 0; j < 4; ++j) s[i][j] = _mm512_setzero_ps();
  const uint32_t* const* qt = rows.q + t0;
  if (nvec == 4) {
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m512i k0 = _mm512_loadu_si512(kc + (0 * kPairs + p) * 32);
      const __m512i k1 = _mm512_loadu_si512(kc + (1 * kPairs + p) * 32);
      const __m512i k2 = _mm512_loadu_si512(kc + (2 * kPairs + p) * 32);
      const __m512i k3 = _mm512_loadu_si512(kc + (3 * kPairs + p) * 32);
      for (int64_t i = 0; i < kTile; ++i) {
        const __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(qt[i][p])));
        s[i][0] = _mm512_dpbf16_ps(s[i][0], as_bh(k0), qb);
        s[i][1] = _mm512_dpbf16_ps(s[i][1], as_bh(k1), qb);
        s[i][2] = _mm512_dpbf16_ps(s[i][2], as_bh(k2), qb);
        s[i][3] = _mm512_dpbf16_ps(s[i][3], as_bh(k3), qb);
      }
    }
  } else {
    for (int64_t p = 0; p < kPairs; ++p) {
      for (int64_t j = 0; j < nvec; ++j) {
        const __m512i kj = _mm512_loadu_si512(kc + (j * kPairs + p) * 32);
        for (int64_t i = 0; i < kTile; ++i)
          s[i][j] = _mm512_dpbf16_ps(s[i][j], as_bh(kj), as_bh(_mm512_set1_epi32(static_cast<int>(qt[i][p]))));
      }
    }
  }
  for (int64_t i = 0; i < kTile; ++i) softmax_row(rows, t0 + i, c0, nvec, s[i], probs[i], scale);
  // values: o += p @ V over this chunk's key pairs, 64 output dims (4 vectors per row) at a time
  const int64_t pairs = nvec * 8;
  for (int64_t h = 0; h < kDim; h += 64) {
    __m512 o[kTile][4];
    for (int64_t i = 0; i < kTile; ++i)
      for (int64_t j = 0; j < 4; ++j) o[i][j] = _mm512_load_ps(rows.o + (t0 + i) * kDim + h + 16 * j);
    for (int64_t kp2 = 0; kp2 < pairs; ++kp2) {
      const uint16_t* vk = vc + kp2 * 2 * kDim + 2 * h;
      const __m512i v0 = _mm512_loadu_si512(vk);
      const __m512i v1 = _mm512_loadu_si512(vk + 32);
      const __m512i v2 = _mm512_loadu_si512(vk + 64);
      const __m512i v3 = _mm512_loadu_si512(vk + 96);
      for (int64_t i = 0; i < kTile; ++i) {
        const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(probs[i][kp2])));
        o[i][0] = _mm512_dpbf16_ps(o[i][0], as_bh(v0), pb);
        o[i][1] = _mm512_dpbf16_ps(o[i][1], as_bh(v1), pb);
        o[i][2] = _mm512_dpbf16_ps(o[i][2], as_bh(v2), pb);
        o[i][3] = _mm512_dpbf16_ps(o[i][3], as_bh(v3), pb);
      }
    }
    for (int64_t i = 0; i < kTile; ++i)
      for (int64_t j = 0; j < 4; ++j) _mm512_store_ps(rows.o + (t0 + i) * kDim + h + 16 * j, o[i][j]);
  }
}

}  // namespace
