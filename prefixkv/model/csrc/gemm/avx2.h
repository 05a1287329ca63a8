// The row-invariant products' AVX2 + FMA path (matmul "avx2": AMD EPYC Zen 3 and older; the "avx2" variant of
// native.py builds it on any CPU for the tests), bf16 (run) and float32 (run_f32). Part of gemm.cpp's translation
// unit.
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

// The float32 product on this build: each output element is one chain of fp32 FMAs over K in order 0, 1, 2, ...
// from zero, then + bias, whatever M (as the bf16 chains above). Why: torch's fp32 matmul (MKL) reads a weight at
// about a third of the memory bandwidth for one to sixteen rows on this CPU (AMD EPYC Zen 3, 2 threads: SmolLM2's
// 113 MB lm_head at one row in 9.6 ms, 12 GB/s, where the machine streams 28.9 GB/s; this kernel 4.4 ms, see
// docs/benchmarks/kernel_ab/gemm_float32_amd_epyc_avx2.json), and a row's bits depend on M there.
// Tiles are 6 rows x 16 columns (12 chains, as many as the 16 ymm registers hold beside 2 weight vectors and a
// broadcast), the row tail in smaller ones; a single row takes the whole panel (8 chains, each K step's 256 bytes
// read once).
namespace {

template <int R, int V>
__attribute__((noinline)) void tile_f32(const ProblemF32& pb, int64_t m0, int64_t p, int64_t first_vec) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* a[R];
  for (int r = 0; r < R; ++r) a[r] = pb.x + (m0 + r) * pb.lda;
  const float* b = pb.panel(p) + first_vec * 8;
  for (int64_t kk = 0; kk < pb.k; ++kk) {
    const float* row = b + kk * kPanel;
    __m256 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm256_loadu_ps(row + v * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xa = _mm256_set1_ps(a[r][kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xa, w[v], acc[r][v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = p * kPanel + (first_vec + v) * 8;
    if (col >= pb.n) break;
    const int64_t count = std::min<int64_t>(8, pb.n - col);
    for (int r = 0; r < R; ++r) {
      alignas(32) float sums[8];
      _mm256_store_ps(sums, acc[r][v]);
      float* y = pb.y + (m0 + r) * pb.ldy + col;
      for (int64_t i = 0; i < count; ++i) y[i] = pb.bias != nullptr ? sums[i] + pb.bias[col + i] : sums[i];
    }
  }
}

// Rows [m0, m0 + R) x panel p, in tiles of V vectors across the panel
template <int R, int V>
void panel_f32(const ProblemF32& pb, int64_t m0, int64_t p) {
  for (int64_t first = 0; first < kPanel / 8 && p * kPanel + first * 8 < pb.n; first += V) tile_f32<R, V>(pb, m0, p, first);
}

void run_f32(const ProblemF32& pb) {
  for_each_block(pb, 6, [&](int64_t ma, int64_t mz, int64_t pa, int64_t pz) {
    for (int64_t p = pa; p < pz; ++p) {
      int64_t m = ma;
      for (; m + 6 <= mz; m += 6) panel_f32<6, 2>(pb, m, p);
      switch (mz - m) {
        case 5: panel_f32<5, 2>(pb, m, p); break;
        case 4: panel_f32<4, 2>(pb, m, p); break;
        case 3: panel_f32<3, 2>(pb, m, p); break;
        case 2: panel_f32<2, 4>(pb, m, p); break;
        case 1: panel_f32<1, 8>(pb, m, p); break;
        default: break;
      }
    }
  });
}

}  // namespace

static constexpr bool kGemmF32 = true;
static constexpr const char* kGemmIsa = "avx2";
