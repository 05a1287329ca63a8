// Attention for CPU in bfloat16 with AVX-512 BF16 dot products, reading K/V from the paged pool; on a CPU without
// AVX512_BF16 the same kernels are built on AVX2 + FMA in float32 (the AVX2 section below).
//
// One head_dim per translation unit: this file builds head_dim 64 (PREFIXKV_HEAD_DIM unset) and
// flash_attention_d128.cpp includes it again for 128. Each build's entry points carry the dim in their names
// (flash_attention_d64, ...); the 64 build also holds the dispatchers the bindings call, which pick the build from
// the query's last dim. Every loop over the head's dims runs in whole 32- or 64-dim blocks in the same order, so
// the 64 build computes what it did before the dim became a parameter, bit for bit.
// Two entry points share one arithmetic:
// - flash_attention: many query rows against one key range (a prefill chunk, fresh or after cached tokens; the
//   stacked queries of several chunks or decodes against a shared prefix);
// - paged_flash_decode: one query token per sequence, each over its own pages.
// Both return each row's log-sum-exp (to merge pieces over disjoint key ranges) and can hand over / pick up the
// raw online-softmax state instead, so attention over keys [0, P) then [P, L) continues exactly where one pass
// over [0, L) would be after key P (bit for bit when P is a multiple of kChunk): that is how shared prefixes are
// attended once without changing any row's result (cache-invariant bf16, see KernelOptions.cache_invariant).
//
// Why one arithmetic: a token's attention must not depend on whether its context was computed this step or read
// from the cache, nor on how the scheduler cut the prompt into chunks (a 1-token chunk runs as a decode). Every
// row therefore walks its keys from key 0 in chunks of kChunk, and one compiled function (attend_chunk) does a
// tile of rows against one chunk for both entry points.
//
// Why a kernel at all: torch's CPU flash kernel reaches ~60-120 GFLOPS on SmolLM2's shapes (3 kv heads of 64, 9
// query heads), under a third of what the same CPU does in the model's matmuls.
// Layout: K and V are packed into bf16 pairs (K: 16 keys x 2 dims per vector, so one dot-product instruction
// scores 16 keys; V: 2 keys x 16 dims, so one adds 2 keys' values into 16 output dims): once per call for
// flash_attention, chunk by chunk (in registers, then L1) for decodes. Work items are (kv head, block of query
// positions) or (sequence, kv head); the query heads of a kv head share its packed K/V (GQA without expanding).
// Online softmax in float32; probabilities are rounded to bfloat16 for the value product, and the row sums use
// the rounded values so the weights stay normalised. The drivers, row state and handover below are shared by both
// builds; the packing, the chunk routine and the row finish are each build's own.
//
// On AMX (isa kAmx; kAmxEmulated runs the same code on amx.h's emulated tiles, for tests anywhere) a tile of 16
// rows does the two products on tiles: scores as Q [16 x 64] . K^T per 16-key group (two tdpbf16ps over the head
// dim's halves), values as O [16 x 16 dims] += P [16 x 32 keys] . V twice per chunk, read from the same packed K/V
// (a B tile is 16 rows of the packing at a 64- or 256-byte stride). The softmax between them is the AVX-512 code
// above, row by row. Every row still walks its keys from key 0 in 64-key chunks, so decodes and prefills, cached
// or fresh, compute a row alike on one CPU; the AMX and AVX-512 paths round differently from each other, and an
// engine uses one of them throughout (KernelOptions.amx_attention).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flash_attention.h"

#ifndef PREFIXKV_HEAD_DIM
#define PREFIXKV_HEAD_DIM 64
#endif
#define PREFIXKV_CAT2(a, b) a##b
#define PREFIXKV_CAT(a, b) PREFIXKV_CAT2(a, b)
#define PREFIXKV_PER_DIM(name) PREFIXKV_CAT(name##_d, PREFIXKV_HEAD_DIM)  // flash_attention -> flash_attention_d64

#if PREFIXKV_HEAD_DIM == 64
void prefixkv::attention::check_pages(const at::Tensor& table, const at::Tensor& lens, int64_t rows,
                                      int64_t page_size, const char* who) {
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && table.is_contiguous() &&
                  lens.is_contiguous(),
              who, ": table / lens must be contiguous int64");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == rows && lens.numel() == rows, who,
              ": one table row and length per sequence");
  TORCH_CHECK(page_size >= 1, who, ": page_size must be >= 1");
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(len[r] >= 1 && len[r] <= table.size(1) * page_size, who,
                ": each length must be in [1, pages * page_size]");
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PREFIXKV_ATTENTION_ISA "avx512_bf16"
#elif defined(__AVX2__) && defined(__FMA__)
#define PREFIXKV_ATTENTION_ISA "avx2"
#endif

#ifdef PREFIXKV_ATTENTION_ISA
#include <immintrin.h>

#include "parallel.h"
#include "simd.h"

namespace {

// which instructions do the two products: the build's vector ones (AVX512_BF16 dot products, or float32 FMAs on
// an AVX2 build), AMX tiles, or AMX on emulated tiles (tests); the last two in AVX-512 builds only
enum Isa : int64_t { kVector = 0, kAmx = 1, kAmxEmulated = 2 };
constexpr int64_t kAmxTile = 16;  // query rows per AMX tile

constexpr int64_t kDim = PREFIXKV_HEAD_DIM;  // head_dim this build covers: 64 or 128
static_assert(kDim % 64 == 0, "the kernels walk the head's dims in 64-dim blocks");
constexpr int64_t kPairs = kDim / 2;  // bf16 pairs per row
constexpr int64_t kKeysPerVec = 16;   // keys per packing group (one AVX-512 vector of scores, two AVX2 ones)
constexpr int64_t kChunk = 64;        // keys per softmax step

// slots[i] = the pool slot of position c0 + i, for i < count, from a sequence's page ids: one division for the
// chunk, not one per key (a runtime page size makes each a hardware divide: ~0.9 ms a 16-stream decode step)
void chunk_slots(const int64_t* pages, int64_t page_size, int64_t c0, int64_t count, int64_t* slots) {
  int64_t page = c0 / page_size, offset = c0 % page_size;
  for (int64_t i = 0; i < count; ++i) {
    slots[i] = pages[page] * page_size + offset;
    if (++offset == page_size) {
      offset = 0;
      ++page;
    }
  }
}

constexpr int64_t kStateWidth = kDim + 2;  // a row's state: unnormalised output (kDim floats), running max, sum

// Per-row online-softmax state of one work item (rows padded to whole tiles)
struct Rows {
  const uint32_t** q;  // the row's query (kPairs bf16 pairs)
  int64_t* see;        // the last key the row sees
  float* m;            // running max of scaled scores
  float* l;            // running sum of exp(score - m), of the probabilities the value product reads
  float* o;            // unnormalised output, kDim floats per row, 64-byte aligned
  // AMX only: the queries copied row after row (A tiles need one stride), a tile's scores and probabilities
  uint16_t* q_rows;    // [rows][kDim] bf16
  float* scores;       // [16][64]
  uint32_t* probs;     // [16][32] bf16 pairs
  // AVX2 builds only: the queries widened to float32, row after row
  float* qf;           // [rows][kDim]
};

void init_row(const Rows& rows, int64_t r, const float* state) {
  if (state == nullptr) {
    rows.m[r] = -std::numeric_limits<float>::infinity();
    rows.l[r] = 0.f;
    std::memset(rows.o + r * kDim, 0, sizeof(float) * kDim);
  } else {
    std::memcpy(rows.o + r * kDim, state, sizeof(float) * kDim);
    rows.m[r] = state[kDim];
    rows.l[r] = state[kDim + 1];
  }
}

using prefixkv::bf16_to_float;

// packed K / V elements: bf16 pairs for the AVX512_BF16 dot products, float32 (widened) for AVX2's FMAs
#if defined(__AVX512BF16__) && defined(__AVX512F__)
using Packed = uint16_t;
#else
using Packed = float;
#endif

using ChunkFn = void (*)(const Packed*, const Packed*, int64_t, int64_t, const Rows&, float);

// The chunk routine, its rows per tile, and the tile set-up of one thread's work, for an isa (Path::of: each
// build's own, below)
struct Path {
  ChunkFn attend;
  int64_t tile;
  void (*begin)();
  void (*end)();

  static Path of(int64_t isa);
};

}  // namespace
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include "amx.h"

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

// attend_chunk on AMX tiles (Tiles: prefixkv::HwTiles or EmuTiles) for rows [t0, t0 + 16): the scores of the
// chunk's nvec 16-key groups in tmm0-3 (per 64-dim block of the head: Q halves in tmm4-5, K halves in tmm6-7),
// the softmax row by row, then each 16-dim block of the output (tmm0-3 in turn, loaded from and stored back to
// the rows' float32 state) += P . V over the
// chunk's first 32 keys and, when the chunk has more, its last 32 (P halves in tmm4-5, V in tmm6-7). The chunk's K
// and V must be packed for all 64 keys (zeros past the sequence). Not inlined, for the reason attend_chunk is not.
template <class Tiles>
__attribute__((noinline)) void attend_chunk_amx(const uint16_t* kc, const uint16_t* vc, int64_t c0, int64_t t0,
                                                const Rows& rows, float scale) {
  int64_t tile_see = 0;
  for (int64_t i = 0; i < kAmxTile; ++i) tile_see = std::max(tile_see, rows.see[t0 + i]);
  if (tile_see < c0) return;
  const int64_t nvec = std::min<int64_t>(4, (tile_see - c0) / kKeysPerVec + 1);
  constexpr int64_t kQStride = kDim * 2, kKStride = 64, kVStride = 2 * kDim * 2, kSStride = kChunk * 4;
  const uint16_t* q = rows.q_rows + t0 * kDim;
  // each 64-dim block of the head: its Q halves in tmm4-5, then every group's K halves into its scores tile
  auto scores = [&]<int G>(int64_t block) {
    if (block == 0) Tiles::template zero<G>();
    const uint16_t* k = kc + G * kPairs * 32 + block * 32 * 32;  // pairs 32 block .. 32 block + 31 of group G
    Tiles::template load<6>(k, kKStride);
    Tiles::template load<7>(k + 16 * 32, kKStride);
    Tiles::template dot<G, 4, 6>();
    Tiles::template dot<G, 5, 7>();
  };
  for (int64_t block = 0; block < kDim / 64; ++block) {
    Tiles::template load<4>(q + 64 * block, kQStride);
    Tiles::template load<5>(q + 64 * block + 32, kQStride);
    scores.template operator()<0>(block);
    if (nvec > 1) scores.template operator()<1>(block);
    if (nvec > 2) scores.template operator()<2>(block);
    if (nvec > 3) scores.template operator()<3>(block);
  }
  Tiles::template store<0>(rows.scores, kSStride);
  if (nvec > 1) Tiles::template store<1>(rows.scores + 1 * kKeysPerVec, kSStride);
  if (nvec > 2) Tiles::template store<2>(rows.scores + 2 * kKeysPerVec, kSStride);
  if (nvec > 3) Tiles::template store<3>(rows.scores + 3 * kKeysPerVec, kSStride);
  for (int64_t i = 0; i < kAmxTile; ++i) {
    __m512 s[4];
    for (int64_t j = 0; j < 4; ++j) s[j] = _mm512_load_ps(rows.scores + i * kChunk + j * kKeysPerVec);
    softmax_row(rows, t0 + i, c0, nvec, s, rows.probs + i * (kChunk / 2), scale);
  }
  constexpr int64_t kPStride = kChunk * 2, kOStride = kDim * 4;
  float* o = rows.o + t0 * kDim;
  Tiles::template load<4>(rows.probs, kPStride);
  if (nvec > 2) Tiles::template load<5>(rows.probs + kChunk / 4, kPStride);
  // output dims 16 block .. 16 block + 15 in tile T (the four tiles taken in turn)
  auto values = [&]<int T>(int64_t block) {
    Tiles::template load<T>(o + block * 16, kOStride);
    Tiles::template load<6>(vc + block * 32, kVStride);
    Tiles::template dot<T, 4, 6>();
    if (nvec > 2) {
      Tiles::template load<7>(vc + 16 * 2 * kDim + block * 32, kVStride);
      Tiles::template dot<T, 5, 7>();
    }
    Tiles::template store<T>(o + block * 16, kOStride);
  };
  for (int64_t block = 0; block < kDim / 16; block += 4) {
    values.template operator()<0>(block);
    values.template operator()<1>(block + 1);
    values.template operator()<2>(block + 2);
    values.template operator()<3>(block + 3);
  }
}

}  // namespace

Path Path::of(int64_t isa) {
  switch (isa) {
    case kAmx:
      TORCH_CHECK(prefixkv::amx_supported(), "native attention: this CPU or OS does not offer AMX tiles");
      return {&attend_chunk_amx<prefixkv::HwTiles>, kAmxTile,
              [] { prefixkv::HwTiles::configure(prefixkv::full_tiles()); }, [] { prefixkv::HwTiles::release(); }};
    case kAmxEmulated:
      return {&attend_chunk_amx<prefixkv::EmuTiles>, kAmxTile,
              [] { prefixkv::EmuTiles::configure(prefixkv::full_tiles()); }, [] {}};
    default:
      TORCH_CHECK(isa == kVector, "native attention: isa must be 0 (AVX-512), 1 (AMX) or 2 (emulated AMX)");
      return {&attend_chunk, kTile, [] {}, [] {}};
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (CPUs without AVX-512, such as AMD EPYC Zen 3): no bf16 dot product, so K, V and the queries are
// widened to float32 (exactly) when they are packed, and each product is one FMA. K is packed [8-key group][64
// dims][8 keys] (a vector holds one dim of 8 keys), V [key][64 dims] (a key's values, 8 vectors). A score is one
// chain of FMAs over the dims in order 0, 1, ..., 63 from zero; an output dim is one chain over the keys in order,
// from the row's state. Probabilities stay float32 (nothing here reads bf16 pairs), and a row's sum adds the
// chunk's vectors in order, then the lanes in a fixed tree. A tile is 2 rows: their 8 score or output chains, 4 K
// or V vectors and 2 broadcasts fit the 16 ymm registers. The bits differ from the AVX512_BF16 path's; within
// one build every row is computed alike, whatever its tile, chunking or caller, as above.
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

// no tiles to set up here
Path Path::of(int64_t isa) {
  TORCH_CHECK(isa == kVector, "native attention: this build (AVX2, no AVX-512) runs isa 0 only; AMX needs AVX-512");
  return {&attend_chunk, kTile, [] {}, [] {}};
}

#endif

#ifdef PREFIXKV_ATTENTION_ISA
namespace {

// Per-thread storage of a work item's row state
struct RowStorage {
  std::vector<float> o_state, m, l, scores, q_float;
  std::vector<int64_t> see;
  std::vector<const uint32_t*> q;
  std::vector<uint16_t> q_rows;
  std::vector<uint32_t> probs;
  Rows rows;

  template <class T>
  static T* aligned(std::vector<T>& v) {
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
  }

  // amx: also the AMX buffers (queries copied, a tile's scores and probabilities); an AVX2 build also widens
  // the queries
  RowStorage(int64_t max_rows, bool amx)
      : o_state(max_rows * kDim + 16),
        m(max_rows),
        l(max_rows),
        scores(amx ? kAmxTile * kChunk + 16 : 0),
        q_float(kFloatQueries ? max_rows * kDim + 16 : 0),
        see(max_rows),
        q(max_rows),
        q_rows(amx ? max_rows * kDim + 32 : 0),
        probs(amx ? kAmxTile * kChunk / 2 + 16 : 0) {
    rows = Rows{q.data(),
                see.data(),
                m.data(),
                l.data(),
                aligned(o_state),
                amx ? aligned(q_rows) : nullptr,
                amx ? aligned(scores) : nullptr,
                amx ? aligned(probs) : nullptr,
                kFloatQueries ? aligned(q_float) : nullptr};
  }

  // row r's query: pointed to, for AMX copied into the row-after-row block, for an AVX2 build widened
  void set_query(int64_t r, const uint16_t* query) {
    rows.q[r] = reinterpret_cast<const uint32_t*>(query);
    if (rows.q_rows != nullptr) std::memcpy(rows.q_rows + r * kDim, query, kDim * sizeof(uint16_t));
    if (rows.qf != nullptr)
      for (int64_t d = 0; d < kDim; ++d) rows.qf[r * kDim + d] = bf16_to_float(query[d]);
  }
};

// One thread's scratch for the items it takes: row state and buffers, a chunk of packed K and V (decodes), and
// the tiles set up for the path
struct Scratch {
  RowStorage storage;
  const Path& path;
  std::vector<Packed> chunk;

  Scratch(int64_t max_rows, const Path& p, bool amx, bool decode = false)
      : storage(max_rows, amx), path(p), chunk(decode ? 2 * kChunk * kDim + 64 : 0) {
    path.begin();
  }
  Packed* keys() { return RowStorage::aligned(chunk); }
  Packed* values() { return keys() + kChunk * kDim; }
  ~Scratch() { path.end(); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

at::Tensor checked_state(const c10::optional<at::Tensor>& state, int64_t rows, int64_t heads) {
  if (!state.has_value()) return at::Tensor();
  const at::Tensor& s = *state;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == rows && s.size(1) == heads &&
                  s.size(2) == kStateWidth,
              "state must be float32 [rows, heads, head_dim + 2] (as returned with return_state)");
  return s.contiguous();
}

void check_inputs(const at::Tensor& q, const at::Tensor& kv) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "native attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16, "native attention is bf16");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kDim && kv.dim() == 4 && kv.size(0) == 2 && kv.size(3) == kDim &&
                  kv.stride(3) == 1,
              "expected q [R, H, D] and kv [2, KVH, slots, D], D = ", kDim);
  TORCH_CHECK(q.size(1) % kv.size(1) == 0, "query heads must be a multiple of kv heads");
}

}  // namespace

// q [R, H, 64] bf16; kv [2, KVH, S, 64] bf16 (last dim contiguous); slots [L] int64: slot of key j; q_pos [R]
// int64: row r sees keys j <= q_pos[r] (and j < L). Every row must see key 0. state_in [R, H, 66] float32: start
// from this state (keys before these L, as returned with return_state) instead of from nothing. Returns {out
// [R, H, 64] bf16, lse [R, H] float32 (natural log of the sum of exp(scale * score))} and, with return_state,
// the state [R, H, 66]. isa: 0 AVX512_BF16 dot products, 1 AMX tiles, 2 AMX kernels on emulated tiles (tests).
std::vector<at::Tensor> PREFIXKV_PER_DIM(flash_attention)(at::Tensor q, at::Tensor kv, at::Tensor slots,
                                                          at::Tensor q_pos, double scale,
                                                          c10::optional<at::Tensor> state_in, bool return_state,
                                                          int64_t isa) {
  check_inputs(q, kv);
  const Path path = Path::of(isa);
  TORCH_CHECK(slots.scalar_type() == at::kLong && q_pos.scalar_type() == at::kLong, "slots / q_pos must be int64");
  TORCH_CHECK(q_pos.size(0) == q.size(0), "one q_pos per query row");
  q = q.contiguous();
  slots = slots.contiguous();
  q_pos = q_pos.contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = kv.size(1), group = heads / kv_heads;
  const at::Tensor state0 = checked_state(state_in, rows, heads);
  const int64_t length = slots.size(0);
  TORCH_CHECK(length >= 1, "flash_attention needs at least one key");
  // keys rounded up to whole vectors (and to even pairs); to whole 64-key chunks for AMX, whose tiles read them
  const int64_t key_unit = isa == kVector ? kKeysPerVec : kChunk;
  const int64_t padded = (length + key_unit - 1) / key_unit * key_unit;
  const int64_t groups16 = padded / kKeysPerVec;
  auto out = at::empty_like(q);
  auto lse = at::empty({rows, heads}, q.options().dtype(at::kFloat));
  auto state = return_state ? at::empty({rows, heads, kStateWidth}, q.options().dtype(at::kFloat)) : at::Tensor();
  auto kp = at::empty({kv_heads, padded * kDim}, q.options().dtype(kPackedType));
  auto vp = at::empty({kv_heads, padded * kDim}, q.options().dtype(kPackedType));
  const uint16_t* kv_ptr = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  const int64_t kv_stride = kv.stride(0), head_stride = kv.stride(1), slot_stride = kv.stride(2);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t* pos_ptr = q_pos.data_ptr<int64_t>();
  Packed* kp_ptr = static_cast<Packed*>(kp.data_ptr());
  Packed* vp_ptr = static_cast<Packed*>(vp.data_ptr());
  const int64_t kp_head = padded * kDim, vp_head = padded * kDim;  // either layout: 64 elements per key

  prefixkv::parallel_items(kv_heads * groups16, [&](int64_t item) {
    const int64_t h = item / groups16, g16 = item % groups16;
    pack_keys(kv_ptr + h * head_stride, slot_stride, slot_ptr, length, g16, kp_ptr + h * kp_head);
    for (int64_t pair = g16 * 8; pair < g16 * 8 + 8; ++pair)
      pack_values(kv_ptr + kv_stride + h * head_stride, slot_stride, slot_ptr, length, pair, vp_ptr + h * vp_head);
  });

  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  float* lse_ptr = lse.data_ptr<float>();
  const float* state_in_ptr = state0.defined() ? state0.data_ptr<float>() : nullptr;
  float* state_ptr = return_state ? state.data_ptr<float>() : nullptr;
  // query positions per work item: more share each key chunk while it is in L1, fewer balance short calls
  const int64_t kBlockPositions = rows >= 1024 ? 64 : 16;
  const int64_t blocks = (rows + kBlockPositions - 1) / kBlockPositions;
  const float fscale = static_cast<float>(scale);

  // items are taken from the end: each head's last blocks, which see the most keys, first, so that no thread is
  // left with a long one at the end
  const int64_t items = kv_heads * blocks;
  auto scratch = [&] { return Scratch(kBlockPositions * group + path.tile, path, isa != kVector); };
  prefixkv::parallel_items(items, scratch, [&](Scratch& thread, int64_t i) {
    RowStorage& storage = thread.storage;
    const Rows& st = storage.rows;
    const int64_t item = items - 1 - i;
    const int64_t h = item / blocks, block = item % blocks;
    const int64_t first = block * kBlockPositions, last = std::min(rows, first + kBlockPositions);
    const int64_t item_rows = (last - first) * group;  // rows (position, query head of this kv head)
    const int64_t padded_rows = (item_rows + path.tile - 1) / path.tile * path.tile;
    const Packed* khead = kp_ptr + h * kp_head;
    const Packed* vhead = vp_ptr + h * vp_head;
    int64_t see_max = 0;
    for (int64_t r = 0; r < padded_rows; ++r) {
      const int64_t rr = std::min(r, item_rows - 1);  // padding rows repeat the last real one
      const int64_t pos = first + rr / group, head = h * group + rr % group;
      storage.set_query(r, q_ptr + (pos * heads + head) * kDim);
      st.see[r] = std::min(pos_ptr[pos], length - 1);
      see_max = std::max(see_max, st.see[r]);
      init_row(st, r, state_in_ptr == nullptr ? nullptr : state_in_ptr + (pos * heads + head) * kStateWidth);
    }
    for (int64_t c0 = 0; c0 <= see_max; c0 += kChunk) {
      const Packed* kc = khead + c0 * kDim;
      const Packed* vc = vhead + c0 * kDim;
      for (int64_t t0 = 0; t0 < padded_rows; t0 += path.tile) path.attend(kc, vc, c0, t0, st, fscale);
    }
    for (int64_t r = 0; r < item_rows; ++r) {
      const int64_t idx = (first + r / group) * heads + h * group + r % group;
      float* row_state = state_ptr == nullptr ? nullptr : state_ptr + idx * kStateWidth;
      finish_row(st, r, out_ptr + idx * kDim, lse_ptr + idx, row_state);
    }
  });
  if (return_state) return {out, lse, state};
  return {out, lse};
}

// q [B, H, 64] bf16, one query token per sequence; kv as for flash_attention; table [B, max_pages] int64 page
// ids; lens [B] int64: sequence b attends to its positions [0, lens[b]) (>= 1). Bit for bit what flash_attention
// computes for that row over the same keys (its slots in position order, q_pos = lens[b] - 1). state_in /
// return_state as for flash_attention.
void prefixkv::attention::PREFIXKV_PER_DIM(paged_decode)(const PagedDecode& a, int64_t isa) {
  const Path path = Path::of(isa);
  const int64_t group = a.heads / a.kv_heads;
  // sequences come shortest first (the planner sorts decodes by length): taken from the end, longest first
  const int64_t items = a.batch * a.kv_heads;
  const int64_t padded_rows = (group + path.tile - 1) / path.tile * path.tile;
  auto scratch = [&] { return Scratch(padded_rows, path, isa != kVector, /*decode=*/true); };
  prefixkv::parallel_items(items, scratch, [&](Scratch& thread, int64_t i) {
    RowStorage& storage = thread.storage;
    const Rows& st = storage.rows;
    Packed *kc = thread.keys(), *vc = thread.values();
    const int64_t item = items - 1 - i;
    const int64_t b = item / a.kv_heads, h = item % a.kv_heads, len = a.lens[b];
    const int64_t* pages = a.table + b * a.max_pages;
    for (int64_t r = 0; r < padded_rows; ++r) {
      const int64_t head = h * group + std::min(r, group - 1);  // padding rows repeat the last real one
      storage.set_query(r, a.q + b * a.q_row_stride + head * kDim);
      st.see[r] = len - 1;
      init_row(st, r, a.state_in == nullptr ? nullptr : a.state_in + (b * a.heads + head) * kStateWidth);
    }
    int64_t slots[kChunk];
    for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
      // the vectors holding keys; AMX tiles read the whole chunk (zeros past the sequence)
      const int64_t nvec = isa == kVector ? std::min<int64_t>(4, (len - 1 - c0) / kKeysPerVec + 1) : 4;
      chunk_slots(pages, a.page_size, c0, std::min(kChunk, len - c0), slots);
      pack_chunk_keys(a.kv + h * a.head_stride, a.slot_stride, slots, c0, len, nvec, kc);
      pack_chunk_values(a.kv + a.kv_stride + h * a.head_stride, a.slot_stride, slots, c0, len, nvec * 8, vc);
      for (int64_t t0 = 0; t0 < padded_rows; t0 += path.tile) path.attend(kc, vc, c0, t0, st, a.scale);
    }
    for (int64_t r = 0; r < group; ++r) {
      const int64_t idx = b * a.heads + h * group + r;
      float* row_state = a.state == nullptr ? nullptr : a.state + idx * kStateWidth;
      finish_row(st, r, a.out + idx * kDim, a.lse + idx, row_state);
    }
  });
}

// q [B, H, 64] bf16, one query token per sequence; kv as for flash_attention; table [B, max_pages] int64 page
// ids; lens [B] int64: sequence b attends to its positions [0, lens[b]) (>= 1). Bit for bit what flash_attention
// computes for that row over the same keys (its slots in position order, q_pos = lens[b] - 1). state_in /
// return_state as for flash_attention.
std::vector<at::Tensor> PREFIXKV_PER_DIM(paged_flash_decode)(at::Tensor q, at::Tensor kv, at::Tensor table,
                                                             at::Tensor lens, int64_t page_size, double scale,
                                                             c10::optional<at::Tensor> state_in, bool return_state,
                                                             int64_t isa) {
  check_inputs(q, kv);
  q = q.contiguous();
  table = table.contiguous();
  lens = lens.contiguous();
  prefixkv::attention::check_pages(table, lens, q.size(0), page_size, "paged_flash_decode");
  const int64_t batch = q.size(0), heads = q.size(1);
  const at::Tensor state0 = checked_state(state_in, batch, heads);
  auto out = at::empty_like(q);
  auto lse = at::empty({batch, heads}, q.options().dtype(at::kFloat));
  auto state = return_state ? at::empty({batch, heads, kStateWidth}, q.options().dtype(at::kFloat)) : at::Tensor();
  prefixkv::attention::PagedDecode args{};
  args.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  args.q_row_stride = heads * kDim;
  args.batch = batch;
  args.heads = heads;
  args.kv = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  args.kv_stride = kv.stride(0);
  args.head_stride = kv.stride(1);
  args.slot_stride = kv.stride(2);
  args.kv_heads = kv.size(1);
  args.table = table.data_ptr<int64_t>();
  args.max_pages = table.size(1);
  args.lens = lens.data_ptr<int64_t>();
  args.page_size = page_size;
  args.scale = static_cast<float>(scale);
  args.state_in = state0.defined() ? state0.data_ptr<float>() : nullptr;
  args.out = out.data_ptr<c10::BFloat16>();
  args.lse = lse.data_ptr<float>();
  args.state = return_state ? state.data_ptr<float>() : nullptr;
  args.head_dim = kDim;
  prefixkv::attention::PREFIXKV_PER_DIM(paged_decode)(args, isa);
  if (return_state) return {out, lse, state};
  return {out, lse};
}

#else

std::vector<at::Tensor> PREFIXKV_PER_DIM(flash_attention)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                                                          c10::optional<at::Tensor>, bool, int64_t) {
  TORCH_CHECK(false, "flash_attention needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
}

std::vector<at::Tensor> PREFIXKV_PER_DIM(paged_flash_decode)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                                                             double, c10::optional<at::Tensor>, bool, int64_t) {
  TORCH_CHECK(false, "paged_flash_decode needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
}

void prefixkv::attention::PREFIXKV_PER_DIM(paged_decode)(const PagedDecode&, int64_t) {
  TORCH_CHECK(false, "paged_flash_decode needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
}

#define PREFIXKV_ATTENTION_ISA ""

#endif

#if PREFIXKV_HEAD_DIM == 64
// The dispatchers the bindings and the decode loop call: the build for the query's head_dim (64 or 128)
std::vector<at::Tensor> flash_attention_d128(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                                             c10::optional<at::Tensor>, bool, int64_t);
std::vector<at::Tensor> paged_flash_decode_d128(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double,
                                                c10::optional<at::Tensor>, bool, int64_t);

// whether the head_dim is 64 (else 128), failing for any other: the one check of all three dispatchers
static bool is_d64(int64_t head_dim) {
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "native attention covers head_dim 64 and 128, got ", head_dim);
  return head_dim == 64;
}

std::vector<at::Tensor> flash_attention(at::Tensor q, at::Tensor kv, at::Tensor slots, at::Tensor q_pos,
                                        double scale, c10::optional<at::Tensor> state_in, bool return_state,
                                        int64_t isa) {
  TORCH_CHECK(q.dim() == 3, "expected q [R, H, head_dim]");
  auto run = is_d64(q.size(2)) ? &flash_attention_d64 : &flash_attention_d128;
  return run(q, kv, slots, q_pos, scale, state_in, return_state, isa);
}

std::vector<at::Tensor> paged_flash_decode(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                           int64_t page_size, double scale, c10::optional<at::Tensor> state_in,
                                           bool return_state, int64_t isa) {
  TORCH_CHECK(q.dim() == 3, "expected q [B, H, head_dim]");
  auto run = is_d64(q.size(2)) ? &paged_flash_decode_d64 : &paged_flash_decode_d128;
  return run(q, kv, table, lens, page_size, scale, state_in, return_state, isa);
}

void prefixkv::attention::paged_decode(const PagedDecode& args, int64_t isa) {
  (is_d64(args.head_dim) ? &paged_decode_d64 : &paged_decode_d128)(args, isa);
}

bool has_flash_attention() { return PREFIXKV_ATTENTION_ISA[0] != '\0'; }

// the instruction set of the vector path (isa 0): "avx512_bf16", "avx2", or "" (not compiled in)
std::string attention_isa() { return PREFIXKV_ATTENTION_ISA; }
#endif
