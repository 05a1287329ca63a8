// The row-invariant bf16 product's AVX512_BF16 path (matmul "avx512_bf16": AMD EPYC Zen 4 / 5, Intel Xeon since
// Cooper Lake; gemm_amx.cpp runs this file's avx512_block for weights whose K is no whole AMX tile). Part of
// gemm.cpp's translation unit.
#pragma once

#include <immintrin.h>

namespace {

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// R rows x P panels from row m0 and panel p0: the chains of R * P * 4 output vectors over every K pair
template <int R, int P>
__attribute__((noinline)) void tile(const Problem& pb, int64_t m0, int64_t p0) {
  __m512 acc[R][P * kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P * kVecs; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* a[R];
  for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<const uint32_t*>(pb.x + (m0 + r) * pb.lda);
  const uint16_t* b[P];
  for (int q = 0; q < P; ++q) b[q] = pb.panel(p0 + q);
  for (int64_t kp = 0; kp < pb.pairs; ++kp) {
    __m512i bv[P * kVecs];
    for (int q = 0; q < P; ++q)
      for (int v = 0; v < kVecs; ++v) bv[q * kVecs + v] = _mm512_loadu_si512(b[q] + kp * kPairRow + v * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh av = as_bh(_mm512_set1_epi32(static_cast<int>(a[r][kp])));
      for (int j = 0; j < P * kVecs; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], as_bh(bv[j]), av);
    }
  }
  for (int q = 0; q < P; ++q) {
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (p0 + q) * kPanel + v * 16;
      if (col >= pb.n) break;
      const Columns16 cols = columns16(pb, col);
      for (int r = 0; r < R; ++r) store16(pb, cols, m0 + r, col, acc[r][q * kVecs + v]);
    }
  }
}

// Panels [pa, pz) of rows [m0, m0 + R): P panels per tile while at least P remain, then one at a time
template <int R, int P>
void panels(const Problem& pb, int64_t m0, int64_t pa, int64_t pz) {
  int64_t p = pa;
  if constexpr (P > 1)
    for (; p + P <= pz; p += P) tile<R, P>(pb, m0, p);
  for (; p < pz; ++p) tile<R, 1>(pb, m0, p);
}

}  // namespace

namespace prefixkv::gemm {

// Rows [ma, mz) x panels [pa, pz): 6-row tiles, then the row tail by the tile of its size (the same chains)
void avx512_block(const Problem& pb, int64_t ma, int64_t mz, int64_t pa, int64_t pz) {
  int64_t m = ma;
  for (; m + 6 <= mz; m += 6) panels<6, 1>(pb, m, pa, pz);
  switch (mz - m) {
    case 5: panels<5, 1>(pb, m, pa, pz); break;
    case 4: panels<4, 1>(pb, m, pa, pz); break;
    case 3: panels<3, 2>(pb, m, pa, pz); break;
    case 2: panels<2, 3>(pb, m, pa, pz); break;
    case 1: panels<1, 4>(pb, m, pa, pz); break;
    default: break;
  }
}

void run(const Problem& pb) {
  for_each_block(pb, 6, [&](int64_t ma, int64_t mz, int64_t pa, int64_t pz) { avx512_block(pb, ma, mz, pa, pz); });
}

}  // namespace prefixkv::gemm

static constexpr const char* kGemmIsa = "avx512_bf16";
