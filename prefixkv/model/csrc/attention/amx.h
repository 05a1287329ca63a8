// The attention kernels on AMX tiles (isa 1: Intel Xeon since Sapphire Rapids, after its self-test; isa 2 runs
// the same code on ../amx.h's emulated tiles, for tests on any AVX-512 BF16 CPU). A tile of 16 rows does the two
// products on tiles: scores as Q [16 x 64] . K^T per 16-key group (two tdpbf16ps over each 64-dim block's
// halves), values as O [16 x 16 dims] += P [16 x 32 keys] . V twice per chunk, read from avx512_bf16.h's packed
// K/V (a B tile is 16 rows of the packing at a 64- or 256-byte stride). The softmax between them is
// avx512_bf16.h's softmax_row, row by row. Every row still walks its keys from key 0 in 64-key chunks, so decodes
// and prefills, cached or fresh, compute a row alike on one CPU. Part of flash_attention.cpp's translation unit,
// after avx512_bf16.h.
#pragma once

#include "../amx.h"

namespace {

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
