// What prefixkv's row-invariant matrix products share (gemm/gemm.cpp: AVX512_BF16, or AVX2 + FMA on a CPU
// without AVX-512; gemm/gemm_amx.cpp: AMX tiles): the packed weight layout, the checked problem, how rows and
// panels are shared out to threads, and the epilogue.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"

namespace prefixkv::gemm {

constexpr int64_t kPanel = 64;            // output columns per panel
constexpr int64_t kVecs = kPanel / 16;    // 16-column vectors per panel
constexpr int64_t kPairRow = kPanel * 2;  // bf16 per K pair of a panel: 256 bytes

inline int64_t panels_of(int64_t out_features) { return (out_features + kPanel - 1) / kPanel; }

struct Problem {
  const uint16_t* x;     // [M, K] bf16 rows at stride lda (elements), 4-byte aligned pairs
  int64_t lda;
  const uint16_t* w;     // packed [panels][pairs][kPairRow]
  int64_t pairs;         // K pairs (K rounded up to even)
  int64_t m, n;          // rows, output columns
  const uint16_t* bias;  // [N] bf16 or nullptr
  uint16_t* y;           // [M, N] bf16, rows at stride ldy
  int64_t ldy;

  const uint16_t* panel(int64_t p) const { return w + p * pairs * kPairRow; }
  int64_t row_bytes() const { return 4 * pairs; }  // of one x row
};

// The float32 product (gemm_f32, built with the AVX2 kernel): weights packed [panels][K][64 columns] fp32, x and y
// fp32
struct ProblemF32 {
  const float* x;  // [M, K] rows at stride lda (elements)
  int64_t lda;
  const float* w;  // packed [panels][k][kPanel]
  int64_t k;
  int64_t m, n;
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N], rows at stride ldy
  int64_t ldy;

  const float* panel(int64_t p) const { return w + p * k * kPanel; }
  int64_t row_bytes() const { return 4 * k; }
};

// A checked call: the tensors it keeps alive and the Problem over them (defined in gemm/gemm.cpp)
struct Call {
  at::Tensor x, bias, y;
  Problem pb;
};
Call prepare(const char* name, at::Tensor x, const at::Tensor& packed, int64_t n,
             const c10::optional<at::Tensor>& bias);

// The products of gemm and amx_gemm on a Problem whose buffers the caller owns: no checks, no allocation
// (gemm/, gemm/gemm_amx.cpp; decode_layers.cpp calls them with its step's workspace)
void run(const Problem& pb);
void run_amx(const Problem& pb);

// Work items are (row block, group of panels); fn(ma, mz, pa, pz) is called for each, in parallel (parallel.h:
// handed out one at a time). Items follow each other by panel within a row block, so the x rows of a block stay
// in L2 while the threads walk its panels. Row blocks are whole row_tile tiles of about 192 KB of x, equal in
// size; groups are 4 panels (their weights stay in L2 across the block's tiles) when there are items enough for
// every thread, else one panel each. A product of at most one row tile (decodes) is one weight stream, so each
// thread takes one contiguous run of panels and reads it front to back (SmolLM2's layer matrices at one row, AMD
// EPYC, 2 threads, cold weights: 0.88-0.96x the time of one panel at a time). Only speed depends on this split:
// every output element is computed by the same chain whatever block or group it falls in.
template <class P, class Fn>
void for_each_block(const P& pb, int64_t row_tile, const Fn& fn) {
  if (pb.m == 0) return;
  const int64_t total_panels = panels_of(pb.n);
  const int64_t fit = (192 * 1024) / pb.row_bytes() / row_tile * row_tile;
  const int64_t max_rows = std::max<int64_t>(row_tile, fit);
  const int64_t row_blocks = (pb.m + max_rows - 1) / max_rows;
  const int64_t row_block = ((pb.m + row_blocks - 1) / row_blocks + row_tile - 1) / row_tile * row_tile;
  const int64_t threads = at::get_num_threads();
  int64_t group = row_blocks * ((total_panels + 3) / 4) >= 8 * threads ? 4 : 1;
  if (pb.m <= row_tile) group = (total_panels + threads - 1) / threads;  // a decode: one run of panels a thread
  const int64_t groups = (total_panels + group - 1) / group;
  parallel_items(row_blocks * groups, [&](int64_t item) {
    const int64_t rb = item / groups, g = item % groups;
    const int64_t ma = rb * row_block, mz = std::min(pb.m, ma + row_block);
    if (ma < mz) fn(ma, mz, g * group, std::min(total_panels, (g + 1) * group));
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The epilogue both kernels end with: 16 output columns from col (the mask keeps those < n) and their bias,
// then each row's fp32 sums plus bias rounded to bf16 and stored.
struct Columns16 {
  __mmask16 mask;
  __m512 bias;  // zeros without a bias
};

inline Columns16 columns16(const Problem& pb, int64_t col) {
  const __mmask16 mask = pb.n - col >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (pb.n - col)) - 1);
  __m512 bias = _mm512_setzero_ps();
  if (pb.bias != nullptr) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, pb.bias + col);
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  return {mask, bias};
}

inline void store16(const Problem& pb, const Columns16& cols, int64_t row, int64_t col, __m512 sums) {
  if (pb.bias != nullptr) sums = _mm512_add_ps(sums, cols.bias);
  _mm256_mask_storeu_epi16(pb.y + row * pb.ldy + col, cols.mask, (__m256i)_mm512_cvtneps_pbh(sums));
}
#endif

}  // namespace prefixkv::gemm
