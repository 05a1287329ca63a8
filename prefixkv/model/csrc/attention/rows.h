// What the attention kernels of every instruction set share: the head_dim of this build, the per-row
// online-softmax state (Rows), and the Path each isa's chunk routine is called through. Part of
// flash_attention.cpp's translation unit (one per head_dim: PREFIXKV_HEAD_DIM), not a header of its own.
#pragma once

#include <immintrin.h>

#include "../parallel.h"
#include "../simd.h"

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

// The chunk routine, its rows per tile, and the tile set-up of one thread's work, for an isa (Path::of, in
// flash_attention.cpp: each build's own)
struct Path {
  ChunkFn attend;
  int64_t tile;
  void (*begin)();
  void (*end)();

  static Path of(int64_t isa);
};

}  // namespace
