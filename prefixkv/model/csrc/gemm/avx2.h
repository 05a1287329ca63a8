// The row-invariant products' AVX2 + FMA path (matmul "avx2": AMD EPYC Zen 3 and older; the "avx2" variant of
// native.py builds it on any CPU for the tests), bf16 (run); the float32 product is f32_avx2.h. Part of gemm.cpp's
// translation unit.
// No bf16 dot product, so each K pair is two float32 FMAs, the even element's then the odd one's, into one
// accumulator per output element. The same fixed chain for every row whatever M, as gemm.cpp says (its bits
// differ from the AVX512_BF16 chain's, which rounds a pair once).
// Weights stay in the shared panel layout; a tile is R rows x half a panel (32 columns, 4 vectors of 8), so its
// 4R accumulators, the pair's two converted vectors and the rows' broadcasts fit the 16 ymm registers.
#pragma once

#include <immintrin.h>

namespace {

constexpr int64_t kHalf = kPanel / 2;  // 32 columns: 4 vectors of 8

// 8 fp32 sums (+ bias) -> bf16 rounded to nearest even (as torch rounds; sums here are never NaN), the first
// `count` of them stored
inline void store8(const Problem& pb, int64_t row, int64_t col, int64_t count, __m256 sums) {
  alignas(32) float out[8];
  _mm256_store_ps(out, sums);
  uint16_t* y = pb.y + row * pb.ldy + col;
  for (int64_t i = 0; i < count; ++i) {
    float v = out[i];
    if (pb.bias != nullptr) {
      uint32_t b = static_cast<uint32_t>(pb.bias[col + i]) << 16;
      float bias;
      std::memcpy(&bias, &b, 4);
      v += bias;
    }
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    y[i] = static_cast<uint16_t>(bits >> 16);
  }
}

// the float whose bits are `bits` (a bf16 value in the high half), in every lane
inline __m256 lane_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return _mm256_set1_ps(f);
}

// R rows from m0 x the 32 columns of half `h` of panel p: 4R chains over every K pair
template <int R>
__attribute__((noinline)) void tile(const Problem& pb, int64_t m0, int64_t p, int64_t h) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  const uint32_t* a[R];
  for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<const uint32_t*>(pb.x + (m0 + r) * pb.lda);
  const uint16_t* b = pb.panel(p) + h * 2 * kHalf;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < pb.pairs; ++kp) {
    __m256 even_a[R], odd_a[R];
    for (int r = 0; r < R; ++r) {
      const uint32_t pair = a[r][kp];
      even_a[r] = lane_float(pair << 16);
      odd_a[r] = lane_float(pair & 0xFFFF0000u);
    }
    const uint16_t* row = b + kp * kPairRow;
    for (int v = 0; v < 4; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + v * 16));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm256_fmadd_ps(even_a[r], even, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(odd_a[r], odd, acc[r][v]);
      }
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int64_t col = p * kPanel + h * kHalf + v * 8;
    if (col >= pb.n) break;
    const int64_t count = std::min<int64_t>(8, pb.n - col);
    for (int r = 0; r < R; ++r) store8(pb, m0 + r, col, count, acc[r][v]);
  }
}

}  // namespace

namespace prefixkv::gemm {

// Rows [ma, mz) x panels [pa, pz): 2-row tiles, then the last row alone (the same per-row chains)
void avx2_block(const Problem& pb, int64_t ma, int64_t mz, int64_t pa, int64_t pz) {
  for (int64_t p = pa; p < pz; ++p) {
    for (int64_t h = 0; h < 2; ++h) {
      if (p * kPanel + h * kHalf >= pb.n) break;
      int64_t m = ma;
      for (; m + 2 <= mz; m += 2) tile<2>(pb, m, p, h);
      if (m < mz) tile<1>(pb, m, p, h);
    }
  }
}

void run(const Problem& pb) {
  for_each_block(pb, 2, [&](int64_t ma, int64_t mz, int64_t pa, int64_t pz) { avx2_block(pb, ma, mz, pa, pz); });
}

}  // namespace prefixkv::gemm

static constexpr const char* kGemmIsa = "avx2";
