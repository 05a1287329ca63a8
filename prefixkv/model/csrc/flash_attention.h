// paged_flash_decode of attention/flash_attention.cpp on raw buffers, for callers that own them
// (decode_layers.cpp): the same arithmetic, no checks, no allocation but each thread's scratch.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace prefixkv::attention {

struct PagedDecode {
  const uint16_t* q;     // [B] rows of H x head_dim bf16 (heads contiguous), rows q_row_stride elements apart
  int64_t q_row_stride;
  int64_t batch, heads;
  const uint16_t* kv;    // one layer of the pool: [2, KVH, slots, head_dim] at these strides (elements)
  int64_t kv_stride, head_stride, slot_stride, kv_heads;
  const int64_t* table;  // [B, max_pages] page ids
  int64_t max_pages;
  const int64_t* lens;   // [B] context lengths, each in [1, max_pages * page_size]
  int64_t page_size;
  float scale;
  const float* state_in;  // [B, H, head_dim + 2] or nullptr
  c10::BFloat16* out;     // [B, H, head_dim]
  float* lse;             // [B, H]
  float* state;           // [B, H, head_dim + 2] or nullptr
  int64_t head_dim = 64;  // 64 or 128: which build of the kernels runs
};

// isa: 0 AVX512_BF16, 1 AMX tiles, 2 AMX kernels on emulated tiles; the build for args.head_dim
void paged_decode(const PagedDecode& args, int64_t isa);
// each head_dim's build (attention/flash_attention.cpp, attention/flash_attention_d128.cpp)
void paged_decode_d64(const PagedDecode& args, int64_t isa);
void paged_decode_d128(const PagedDecode& args, int64_t isa);

// The page tables a paged decode reads: table [rows, max_pages] and lens [rows] contiguous int64, page_size >= 1,
// every length in [1, max_pages * page_size] (paged_flash_decode's checks, also the decode loop's); who: the
// caller's name, at the start of the error
void check_pages(const at::Tensor& table, const at::Tensor& lens, int64_t rows, int64_t page_size, const char* who);

}  // namespace prefixkv::attention
