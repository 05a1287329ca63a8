// The quantized matrix product's formats, packed layout and checked problem (gemm_q.cpp; layout described there).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gemm.h"
#include "parallel.h"

namespace prefixkv::qgemm {

enum class Format { Q8_0, Q4_0, Q4_1 };

Format parse_format(const std::string& name, const char* who);

constexpr int kBlock = 32;      // weights per GGUF block (one scale)
constexpr int64_t kPanel = 32;  // output columns per panel: two 16-column vectors

inline int64_t panels_of(int64_t out_features) { return (out_features + kPanel - 1) / kPanel; }

// bytes of one GGUF block: fp16 d (, fp16 m), then the quantized values
constexpr int64_t gguf_block_bytes(Format f) { return f == Format::Q8_0 ? 34 : f == Format::Q4_0 ? 18 : 20; }

// bytes of one (panel, block) of the packed layout: the quantized values of 32 columns x 32 K, then fp16 scales
constexpr int64_t quant_bytes(Format f) { return f == Format::Q8_0 ? kPanel * kBlock : kPanel * kBlock / 2; }
constexpr int64_t panel_block_bytes(Format f) {
  return quant_bytes(f) + 2 * kPanel * (f == Format::Q4_1 ? 2 : 1);
}

struct Problem {
  const uint16_t* x;    // [M, K] bf16 rows at stride lda (elements), 4-byte aligned pairs
  int64_t lda;
  const uint8_t* w;     // packed [panels][blocks][panel_block_bytes]
  int64_t blocks;       // K / 32
  int64_t panel_bytes;  // blocks * panel_block_bytes
  int64_t m;
  const float* xsum;    // q4_1: [M, blocks] each row's sum of x over each block
  gemm::Problem out;    // n, bias and y for gemm.h's epilogue (columns16, store16)

  const uint8_t* panel(int64_t p) const { return w + p * panel_bytes; }
};

// qgemm's product on a Problem whose buffers the caller owns (decode_layers.cpp): no checks, no allocation;
// q4_1's per-block row sums of x are written to xsum ([M, blocks] floats, the caller's; unused by other formats)
void run_format(Format f, Problem& pb, float* xsum);

// Work items (row block, run of consecutive panels), handed out by parallel_items as gemm.h's for_each_block: row
// blocks of about 192 KB of x, whole row_tile tiles; runs of total / (2 x threads) panels, 1 to 16, so that a
// one-row product reads a few long sequential stretches (runs of 4 or 1 panels, as gemm's groups, were 10-25%
// slower on small weights on AMD EPYC) and a preempted thread still holds up only a small part. Only speed depends
// on the split: every output element is computed by the same chain wherever it falls.
template <class Fn>
void for_each_block(const Problem& pb, int64_t row_tile, const Fn& fn) {
  if (pb.m == 0) return;
  const int64_t total_panels = panels_of(pb.out.n);
  const int64_t fit = (192 * 1024) / (2 * kBlock * pb.blocks) / row_tile * row_tile;
  const int64_t max_rows = std::max<int64_t>(row_tile, fit);
  const int64_t row_blocks = (pb.m + max_rows - 1) / max_rows;
  const int64_t row_block = ((pb.m + row_blocks - 1) / row_blocks + row_tile - 1) / row_tile * row_tile;
  const int64_t threads = at::get_num_threads();
  const int64_t group = std::clamp<int64_t>(total_panels * row_blocks / (2 * threads), 1, 16);
  const int64_t groups = (total_panels + group - 1) / group;
  parallel_items(row_blocks * groups, [&](int64_t item) {
    const int64_t rb = item / groups, g = item % groups;
    const int64_t ma = rb * row_block, mz = std::min(pb.m, ma + row_block);
    if (ma < mz) fn(ma, mz, g * group, std::min(total_panels, (g + 1) * group));
  });
}

}  // namespace prefixkv::qgemm
