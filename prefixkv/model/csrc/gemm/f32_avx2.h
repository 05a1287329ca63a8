#pragma once

#include <immintrin.h>

// The float32 product (gemm_f32), AVX2 + FMA, in every build whose CPU has them (AVX-512 ones too, where it
// serves float32 models as on AMD EPYC Zen 3). Part of gemm.cpp's translation unit.
// Each output element is one chain of fp32 FMAs over K in order 0, 1, 2, ... from zero, then + bias, whatever M
// (as the bf16 chains of avx2.h), so its bits are the same in every build. Why: torch's fp32 matmul (MKL) reads a weight at
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
