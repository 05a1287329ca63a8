// Prefill-style attention for CPU in bfloat16 with AVX-512 BF16 dot products (head_dim 64), reading K/V from the
// paged pool by slot. Many query rows against one key range: a prefill chunk (fresh or after cached tokens), the
// stacked queries of several chunks or decodes against a shared prefix. Returns the output and each row's
// log-sum-exp so pieces over disjoint key ranges can be merged exactly.
//
// Why: torch's CPU flash kernel reaches ~60-120 GFLOPS on SmolLM2's shapes (3 kv heads of 64, 9 query heads),
// under a third of what the same CPU does in the model's matmuls; attention was half of a 2048-token prefill.
// Layout: K and V of the key range are first packed once per call into bf16 pairs (K: 16 keys x 2 dims per
// vector, so one dot-product instruction scores 16 keys; V: 2 keys x 16 dims, so one adds 2 keys' values into 16
// output dims). Work items are (kv head, block of query positions); the query heads of a kv head share its
// packed K/V (GQA without expanding). Online softmax in float32; probabilities are rounded to bfloat16 for the
// value product, and the row sums use the rounded values so the weights stay normalised.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t kDim = 64;        // head_dim this kernel covers
constexpr int64_t kPairs = kDim / 2;  // bf16 pairs per row
constexpr int64_t kKeysPerVec = 16;
constexpr int64_t kChunk = 64;      // keys per softmax step (4 vectors of scores per row)
constexpr int64_t kTile = 4;        // query rows computed together

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

}  // namespace

// q [R, H, 64] bf16; kv [2, KVH, S, 64] bf16 (last dim contiguous); slots [L] int64: slot of key j; q_pos [R]
// int64: row r sees keys j <= q_pos[r] (and j < L). Every row must see key 0. Returns {out [R, H, 64] bf16,
// lse [R, H] float32 (natural log of the sum of exp(scale * score))}.
std::vector<at::Tensor> flash_attention(at::Tensor q, at::Tensor kv, at::Tensor slots, at::Tensor q_pos,
                                        double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "flash_attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16, "flash_attention is bf16");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kDim && kv.dim() == 4 && kv.size(3) == kDim && kv.stride(3) == 1,
              "expected q [R, H, 64] and kv [2, KVH, slots, 64]");
  TORCH_CHECK(q.size(1) % kv.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && q_pos.scalar_type() == at::kLong, "slots / q_pos must be int64");
  TORCH_CHECK(q_pos.size(0) == q.size(0), "one q_pos per query row");
  q = q.contiguous();
  slots = slots.contiguous();
  q_pos = q_pos.contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = kv.size(1), group = heads / kv_heads;
  const int64_t length = slots.size(0);
  TORCH_CHECK(length >= 1, "flash_attention needs at least one key");
  const int64_t groups16 = (length + kKeysPerVec - 1) / kKeysPerVec;
  const int64_t padded = groups16 * kKeysPerVec;  // keys rounded up to whole vectors (and to even pairs)
  auto out = at::empty_like(q);
  auto lse = at::empty({rows, heads}, q.options().dtype(at::kFloat));
  auto kp = at::empty({kv_heads, groups16 * kPairs * 32}, q.options().dtype(at::kShort));
  auto vp = at::empty({kv_heads, padded / 2 * 2 * kDim}, q.options().dtype(at::kShort));
  const uint16_t* kv_ptr = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  const int64_t kv_stride = kv.stride(0), head_stride = kv.stride(1), slot_stride = kv.stride(2);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t* pos_ptr = q_pos.data_ptr<int64_t>();
  uint16_t* kp_ptr = reinterpret_cast<uint16_t*>(kp.data_ptr<int16_t>());
  uint16_t* vp_ptr = reinterpret_cast<uint16_t*>(vp.data_ptr<int16_t>());
  const int64_t kp_head = groups16 * kPairs * 32, vp_head = padded / 2 * 2 * kDim;

  at::parallel_for(0, kv_heads * groups16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / groups16, g16 = item % groups16;
      pack_keys(kv_ptr + h * head_stride, slot_stride, slot_ptr, length, g16, kp_ptr + h * kp_head);
      for (int64_t pair = g16 * 8; pair < g16 * 8 + 8; ++pair)
        pack_values(kv_ptr + kv_stride + h * head_stride, slot_stride, slot_ptr, length, pair, vp_ptr + h * vp_head);
    }
  });

  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  float* lse_ptr = lse.data_ptr<float>();
  // query positions per work item: more share each key chunk while it is in L1, fewer balance short calls
  const int64_t kBlockPositions = rows >= 1024 ? 64 : 16;
  const int64_t blocks = (rows + kBlockPositions - 1) / kBlockPositions;
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    // per-row state of one work item; a key chunk stays in L1 while every row tile of the item uses it
    std::vector<float> o_state(kBlockPositions * group * kDim + 16);
    float* o_acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(o_state.data()) + 63) & ~uintptr_t(63));
    std::vector<float> m(kBlockPositions * group + kTile), l(kBlockPositions * group + kTile);
    std::vector<int64_t> see(kBlockPositions * group + kTile);
    std::vector<const uint32_t*> qrow(kBlockPositions * group + kTile);
    alignas(64) uint32_t probs[kTile][kChunk / 2];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 vscale = _mm512_set1_ps(fscale);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, block = item % blocks;
      const int64_t first = block * kBlockPositions, last = std::min(rows, first + kBlockPositions);
      const int64_t item_rows = (last - first) * group;  // rows (position, query head of this kv head)
      const int64_t padded_rows = (item_rows + kTile - 1) / kTile * kTile;
      const uint16_t* khead = kp_ptr + h * kp_head;
      const uint16_t* vhead = vp_ptr + h * vp_head;
      int64_t see_max = 0;
      for (int64_t r = 0; r < padded_rows; ++r) {
        const int64_t rr = std::min(r, item_rows - 1);  // padding rows repeat the last real one
        const int64_t pos = first + rr / group, head = h * group + rr % group;
        qrow[r] = reinterpret_cast<const uint32_t*>(q_ptr + (pos * heads + head) * kDim);
        see[r] = std::min(pos_ptr[pos], length - 1);
        see_max = std::max(see_max, see[r]);
        m[r] = neg_inf;
        l[r] = 0.f;
      }
      std::memset(o_acc, 0, sizeof(float) * padded_rows * kDim);
      for (int64_t c0 = 0; c0 <= see_max; c0 += kChunk) {
        const uint16_t* kc = khead + (c0 / kKeysPerVec) * kPairs * 32;
        const uint16_t* vc = vhead + (c0 / 2) * 2 * kDim;
        for (int64_t t0 = 0; t0 < padded_rows; t0 += kTile) {
          int64_t tile_see = 0;
          for (int64_t i = 0; i < kTile; ++i) tile_see = std::max(tile_see, see[t0 + i]);
          if (tile_see < c0) continue;
          const int64_t nvec = std::min<int64_t>(4, (tile_see - c0) / kKeysPerVec + 1);
          __m512 s[kTile][4];
          for (int64_t i = 0; i < kTile; ++i)
            for (int64_t j = 0; j < 4; ++j) s[i][j] = _mm512_setzero_ps();
          const uint32_t* const* qt = qrow.data() + t0;
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
          // scale, mask, online softmax; probabilities -> bf16 pairs
          for (int64_t i = 0; i < kTile; ++i) {
            const int64_t r = t0 + i;
            float* orow = o_acc + r * kDim;
            __m512 vmax = _mm512_set1_ps(neg_inf);
            __mmask16 visible[4];
            for (int64_t j = 0; j < nvec; ++j) {
              const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0 + 16 * j)));
              visible[j] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(see[r])));
              s[i][j] = _mm512_mask_mul_ps(_mm512_set1_ps(neg_inf), visible[j], s[i][j], vscale);
              vmax = _mm512_max_ps(vmax, s[i][j]);
            }
            const float chunk_max = _mm512_reduce_max_ps(vmax);
            if (chunk_max == neg_inf) {  // nothing visible in this chunk for this row
              for (int64_t j = 0; j < kChunk / 2; ++j) probs[i][j] = 0;
              continue;
            }
            const float m_new = std::max(m[r], chunk_max);
            const float alpha = m[r] == neg_inf ? 0.f : std::exp(m[r] - m_new);
            const __m512 vm = _mm512_set1_ps(m_new);
            __m512 vsum = _mm512_setzero_ps();
            __m512 e[4];
            for (int64_t j = 0; j < 4; ++j) {
              // exp16 clamps its argument, so masked lanes are zeroed explicitly
              e[j] = j < nvec ? _mm512_maskz_mov_ps(visible[j], prefixkv::exp16(_mm512_sub_ps(s[i][j], vm)))
                              : _mm512_setzero_ps();
            }
            // bf16 probabilities in key order are exactly the (key 2j, key 2j + 1) pairs the value product reads
            const __m512bh p01 = _mm512_cvtne2ps_pbh(e[1], e[0]), p23 = _mm512_cvtne2ps_pbh(e[3], e[2]);
            _mm512_store_si512(probs[i], (__m512i)p01);
            _mm512_store_si512(probs[i] + 16, (__m512i)p23);
            for (int64_t j = 0; j < nvec; ++j) vsum = _mm512_add_ps(vsum, prefixkv::round_bf16(e[j]));
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(vsum);
            m[r] = m_new;
            if (alpha != 1.f) {
              const __m512 va = _mm512_set1_ps(alpha);
              for (int64_t d = 0; d < kDim; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(va, _mm512_load_ps(orow + d)));
            }
          }
          // values: o += p @ V over this chunk's key pairs
          __m512 o[kTile][4];
          for (int64_t i = 0; i < kTile; ++i)
            for (int64_t j = 0; j < 4; ++j) o[i][j] = _mm512_load_ps(o_acc + (t0 + i) * kDim + 16 * j);
          const int64_t pairs = nvec * 8;
          for (int64_t kp2 = 0; kp2 < pairs; ++kp2) {
            const __m512i v0 = _mm512_loadu_si512(vc + kp2 * 2 * kDim);
            const __m512i v1 = _mm512_loadu_si512(vc + kp2 * 2 * kDim + 32);
            const __m512i v2 = _mm512_loadu_si512(vc + kp2 * 2 * kDim + 64);
            const __m512i v3 = _mm512_loadu_si512(vc + kp2 * 2 * kDim + 96);
            for (int64_t i = 0; i < kTile; ++i) {
              const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(probs[i][kp2])));
              o[i][0] = _mm512_dpbf16_ps(o[i][0], as_bh(v0), pb);
              o[i][1] = _mm512_dpbf16_ps(o[i][1], as_bh(v1), pb);
              o[i][2] = _mm512_dpbf16_ps(o[i][2], as_bh(v2), pb);
              o[i][3] = _mm512_dpbf16_ps(o[i][3], as_bh(v3), pb);
            }
          }
          for (int64_t i = 0; i < kTile; ++i)
            for (int64_t j = 0; j < 4; ++j) _mm512_store_ps(o_acc + (t0 + i) * kDim + 16 * j, o[i][j]);
        }
      }
      for (int64_t r = 0; r < item_rows; ++r) {
        const int64_t pos = first + r / group, head = h * group + r % group;
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        c10::BFloat16* dst = reinterpret_cast<c10::BFloat16*>(out_ptr + (pos * heads + head) * kDim);
        for (int64_t d = 0; d < kDim; d += 16)
          prefixkv::store16(dst + d, _mm512_mul_ps(inv, _mm512_load_ps(o_acc + r * kDim + d)));
        lse_ptr[pos * heads + head] = m[r] + std::log(l[r]);
      }
    }
  });
  return {out, lse};
}

bool has_flash_attention() { return true; }

#else

std::vector<at::Tensor> flash_attention(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double) {
  TORCH_CHECK(false, "flash_attention needs AVX-512 BF16 (not compiled in)");
}

bool has_flash_attention() { return false; }

#endif
