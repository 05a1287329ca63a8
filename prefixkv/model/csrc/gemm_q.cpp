// Weight-only quantized matrix products y = x dequant(W)^T (+ bias) on the GGUF's own blocks (q8_0, q4_0, q4_1),
// bf16 activations, row-invariant as gemm.cpp: every output element is one fixed chain of instructions over K,
// whatever the number of rows in the call, the row's place in it, the tile or the thread that computes it.
//
// Arithmetic of one output element (row r, column c), for the K / 32 blocks b in order:
//   s_b   = the block's 16 K pairs in order, each by vdpbf16ps(bf16(q) pair, x pair), into a chain from zero
//   acc   = fma(s_b, d_b, acc)                         (q8_0: q int8; q4_0: q = nibble - 8)
//   acc   = fma(sum_x_b, m_b, acc)                     (q4_1 only: q = nibble; sum_x_b = the block's sum of x)
// then acc + bias, rounded once to bf16. The quantized values are small integers (|q| <= 128), exact in bf16, so
// the products q x are exact and this is the float32 product of x with the dequantized weights up to float32
// summation error. sum_x_b is computed once per row and block, in one fixed order, before the tiles.
//
// Why bf16 dot products rather than float32 FMAs on converted weights: vdpbf16ps does 32 multiply-adds where an
// FMA does 16, at the same rate. A row of an FMA kernel would cost as many instructions as a row of the bf16 gemm
// with half the work each, so already at 16 rows (weights read once, compute-bound) it would be slower than the
// bf16 product. The weights are converted in registers, never to memory: q4 by a shift and a table lookup per 32
// weights, q8 by sign extension, int -> float conversion and a float -> bf16 pack (exact for integers).
//
// Tiles: R rows x one or two panels of 32 columns (two 16-column vectors), so each converted weight vector serves
// R rows; 8-row tiles (16 chains) and the row tail by smaller tiles of the same chains. Work items (row block, run
// of consecutive panels) go to threads through parallel_items (gemm_q.h). Memory-bound one-row products read
// each panel as one sequential stream, with software prefetch ahead of it.
//
// Packed layout (qgemm_pack): panels of 32 output columns (two 16-column vectors v = 0, 1), [panel][block][bytes],
// where one (panel, block) holds the quantized values of 32 columns x 32 K, then the 32 columns' scales d (fp16,
// 64 bytes) and, for q4_1, their minimums m (fp16, 64 bytes). Quantized values, read in address order:
//   q4_0, q4_1: 8 chunks of 64 bytes, chunk 2j + v for j = 0..3: 32 little-endian 16-bit words, word 2c + e
//               holding 4 nibbles, bits 4s..4s+3 = q[column 16v + c][k = 2 (4j + s) + e] (k within the block).
//               One 64-byte load gives 4 K pairs of 16 columns; a shift by 4s and a 32-word table lookup (vpermw,
//               which reads the low 5 bits of each word: the table holds its 16 values twice) give the bf16
//               weights of pair 4j + s.
//   q8_0:       32 chunks of 32 bytes, chunk 2p + v for pair p = 0..15: byte 2c + e = q[column 16v + c][k = 2p + e],
//               sign-extended to int32, converted to float and packed to bf16 (vcvtne2ps2bf16) in registers.
// Bytes per weight as in the GGUF: q8_0 1088 / 1024 = 1.0625, q4_0 576 / 1024 = 0.5625, q4_1 640 / 1024 = 0.625.
// Every (panel, block) is a whole number of 64-byte lines, and a tile reads each panel as one sequential stream.
// Columns past N (the last panel's padding) are zero, d = m = 0 included.
#include "gemm_q.h"

#include <cstring>
#include <string>

namespace prefixkv::qgemm {

Format parse_format(const std::string& name, const char* who) {
  if (name == "q8_0") return Format::Q8_0;
  if (name == "q4_0") return Format::Q4_0;
  if (name == "q4_1") return Format::Q4_1;
  TORCH_CHECK(false, who, ": unknown format '", name, "' (expected q8_0, q4_0 or q4_1)");
}

}  // namespace prefixkv::qgemm

using namespace prefixkv::qgemm;

namespace {

// one GGUF block (32 weights of one row) -> the 32 quantized values as stored (q8_0: int8; q4: nibbles 0..15)
// and its scale bits (d, m)
void read_block(Format f, const uint8_t* src, int q[kBlock], uint16_t& d, uint16_t& m) {
  std::memcpy(&d, src, 2);
  m = 0;
  if (f == Format::Q8_0) {
    for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(src[2 + i]);
    return;
  }
  const uint8_t* qs = src + 2;
  if (f == Format::Q4_1) {
    std::memcpy(&m, src + 2, 2);
    qs = src + 4;
  }
  for (int i = 0; i < kBlock / 2; ++i) {
    q[i] = qs[i] & 0x0F;
    q[i + kBlock / 2] = qs[i] >> 4;
  }
}

}  // namespace

// blocks [N, K / 32 * block bytes] uint8 (GGUF rows, one per output feature) -> [panels, K / 32, panel block bytes]
at::Tensor qgemm_pack(at::Tensor blocks, int64_t k, std::string format) {
  const Format f = parse_format(format, "qgemm_pack");
  TORCH_CHECK(k > 0 && k % kBlock == 0, "qgemm_pack: K must be a positive multiple of 32 (the GGUF block), got ", k);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "qgemm_pack: blocks must be a uint8 CPU tensor [N, K / 32 * block bytes]");
  const int64_t nb = k / kBlock, bb = gguf_block_bytes(f);
  TORCH_CHECK(blocks.size(1) == nb * bb, "qgemm_pack: ", format, " blocks of K = ", k, " take ", nb * bb,
              " bytes a row, got ", blocks.size(1));
  blocks = blocks.contiguous();
  const int64_t n = blocks.size(0), panels = panels_of(n), pbb = panel_block_bytes(f);
  auto packed = at::zeros({panels, nb, pbb}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int q[kBlock];
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t c = 0; c < kPanel && panel * kPanel + c < n; ++c) {
        const int64_t v = c / 16, cv = c % 16;
        for (int64_t b = 0; b < nb; ++b) {
          uint16_t d, m;
          read_block(f, src + (panel * kPanel + c) * nb * bb + b * bb, q, d, m);
          uint8_t* out = dst + (panel * nb + b) * pbb;
          if (f == Format::Q8_0) {
            for (int kk = 0; kk < kBlock; ++kk)
              out[((kk / 2) * 2 + v) * 32 + 2 * cv + kk % 2] = static_cast<uint8_t>(static_cast<int8_t>(q[kk]));
          } else {
            for (int kk = 0; kk < kBlock; ++kk) {
              const int pair = kk / 2, e = kk % 2, j = pair / 4, s = pair % 4;
              // word 2 cv + e of chunk j, nibble s: byte 2 * word + s / 2, high half when s is odd
              uint8_t& byte = out[(2 * j + v) * 64 + 2 * (2 * cv + e) + s / 2];
              byte = static_cast<uint8_t>(byte | (q[kk] << (4 * (s % 2))));
            }
          }
          const int64_t scales = quant_bytes(f);
          std::memcpy(out + scales + 2 * c, &d, 2);
          if (f == Format::Q4_1) std::memcpy(out + scales + 2 * kPanel + 2 * c, &m, 2);
        }
      }
    }
  });
  return packed;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

namespace {

constexpr int kRowTile = 8;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// The 16-column vector v's bf16 weights for K pairs of one block are made by Weights<F>: load(ptr) once per
// group of pairs, then pair(i) for the group's pairs in order.
template <Format F>
struct Weights {  // q4_0, q4_1
  static constexpr int kGroup = 4;  // K pairs per 64-byte load
  __m512i raw;
  void load(const uint8_t* p) { raw = _mm512_loadu_si512(p); }
  __m512i pair(int s, __m512i lut) const {
    const __m512i idx = s == 0 ? raw : _mm512_srli_epi16(raw, 4 * s);
    return _mm512_permutexvar_epi16(idx, lut);
  }
  static constexpr int64_t kChunk = 64;
};

template <>
struct Weights<Format::Q8_0> {
  static constexpr int kGroup = 1;
  const uint8_t* ptr;
  void load(const uint8_t* p) { ptr = p; }
  __m512i pair(int, __m512i) const {
    const __m128i* p = reinterpret_cast<const __m128i*>(ptr);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo, 16..31 from hi
  }
  static constexpr int64_t kChunk = 32;
};

// the table vpermw reads: bf16 of each nibble's value, the 16 values twice (indices are the low 5 bits)
template <Format F>
__m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(F == Format::Q4_0 ? (i & 15) - 8 : (i & 15));
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // small integers: exact in bf16
  }
  return _mm512_load_si512(t);
}

// Bytes ahead of the current block that a tile asks the caches for, in each panel it reads (and the first kAhead
// bytes of its panels, when it is the first tile of a run of panels). Without them a one-row product streamed
// ~30 GB/s where a bf16 one streams ~50-70 on AMD EPYC (Zen 5, 2 threads): one row does ~5x more instructions per
// byte here than in gemm.cpp, so the out-of-order window holds far fewer loads in flight. 8 KB ahead into L1 was
// the best of 4-16 KB, L1 or L2 (~55 GB/s for q4_0's lm_head). Prefetches past a panel's end land in the next panel,
// which the same thread reads next (a work item is a run of consecutive panels).
constexpr int64_t kAhead = 8192;

inline void prefetch_lines(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// R rows from m0 x P panels from p0: the chains of R * 2P output vectors over every block; first: the first tile
// of a run of panels (whose start no earlier tile has prefetched)
template <Format F, int R, int P>
__attribute__((noinline)) void tile(const Problem& pb, int64_t m0, int64_t p0, bool first) {
  using W = Weights<F>;
  constexpr int V = 2 * P;
  constexpr int64_t quant = quant_bytes(F), stride = panel_block_bytes(F);
  const __m512i lut = F == Format::Q8_0 ? _mm512_setzero_si512() : nibble_table<F>();
  // the running sums live in memory (one load and store per block and vector, against 16 dot products), so that
  // the registers hold the blocks' chains, the weights and the broadcast x pairs
  alignas(64) float acc_mem[R * V * 16];
  float* acc = acc_mem;
  asm volatile("" : "+r"(acc)::"memory");  // keeps the compiler from promoting acc to registers
  for (int i = 0; i < R * V; ++i) _mm512_store_ps(acc + 16 * i, _mm512_setzero_ps());
  const uint8_t* base[P];
  for (int q = 0; q < P; ++q) {
    base[q] = pb.panel(p0 + q);
    if (first) prefetch_lines(base[q], kAhead);
  }
  const uint32_t* a[R];
  for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<const uint32_t*>(pb.x + (m0 + r) * pb.lda);
  for (int64_t b = 0; b < pb.blocks; ++b) {
    for (int q = 0; q < P; ++q) prefetch_lines(base[q] + b * stride + kAhead, stride);
    __m512 blk[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) blk[r][j] = _mm512_setzero_ps();
    const uint32_t* ab[R];
    for (int r = 0; r < R; ++r) ab[r] = a[r] + b * 16;
    for (int g = 0; g < 16 / W::kGroup; ++g) {
      W w[V];
      for (int q = 0; q < P; ++q)
        for (int v = 0; v < 2; ++v) w[q * 2 + v].load(base[q] + b * stride + (2 * g + v) * W::kChunk);
      for (int s = 0; s < W::kGroup; ++s) {
        const int pair = g * W::kGroup + s;
        for (int j = 0; j < V; ++j) {
          const __m512bh wv = as_bh(w[j].pair(s, lut));
          for (int r = 0; r < R; ++r) {
            const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int>(ab[r][pair])));
            blk[r][j] = _mm512_dpbf16_ps(blk[r][j], wv, xv);
          }
        }
      }
    }
    for (int q = 0; q < P; ++q) {
      const uint8_t* scales = base[q] + b * stride + quant;
      for (int v = 0; v < 2; ++v) {
        const int j = q * 2 + v;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32 * v)));
        if constexpr (F == Format::Q4_1) {
          const __m512 m =
              _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 2 * kPanel + 32 * v)));
          for (int r = 0; r < R; ++r) {
            float* sum = acc + 16 * (r * V + j);
            const __m512 t = _mm512_fmadd_ps(blk[r][j], d, _mm512_load_ps(sum));
            const __m512 xsum = _mm512_set1_ps(pb.xsum[(m0 + r) * pb.blocks + b]);
            _mm512_store_ps(sum, _mm512_fmadd_ps(xsum, m, t));
          }
        } else {
          for (int r = 0; r < R; ++r) {
            float* sum = acc + 16 * (r * V + j);
            _mm512_store_ps(sum, _mm512_fmadd_ps(blk[r][j], d, _mm512_load_ps(sum)));
          }
        }
      }
    }
  }
  for (int q = 0; q < P; ++q) {
    for (int v = 0; v < 2; ++v) {
      const int64_t col = (p0 + q) * kPanel + v * 16;
      if (col >= pb.out.n) break;
      const prefixkv::gemm::Columns16 cols = prefixkv::gemm::columns16(pb.out, col);
      for (int r = 0; r < R; ++r)
        prefixkv::gemm::store16(pb.out, cols, m0 + r, col, _mm512_load_ps(acc + 16 * (r * V + q * 2 + v)));
    }
  }
}

// Panels [pa, pz) of rows [m0, m0 + R): P panels per tile while at least P remain, then one at a time
template <Format F, int R, int P>
void panels(const Problem& pb, int64_t m0, int64_t pa, int64_t pz) {
  int64_t p = pa;
  if constexpr (P > 1)
    for (; p + P <= pz; p += P) tile<F, R, P>(pb, m0, p, p == pa);
  for (; p < pz; ++p) tile<F, R, 1>(pb, m0, p, p == pa);
}

// Rows [ma, mz) x panels [pa, pz): 8-row tiles, then the row tail by the tile of its size (the same chains).
// 8 rows x 32 columns: 16 chains, each weight vector converted once for 8 dot products. Fewer than 8 rows in all
// are bound by memory: one panel at a time, one sequential stream (a tile of 2 panels read 2-4 rows 15-20% slower
// on AMD EPYC). A tail of 2 to 4 rows after full tiles finds the weights in L2, where two panels at a time (8 to 16
// chains) are faster.
template <Format F>
void block(const Problem& pb, int64_t ma, int64_t mz, int64_t pa, int64_t pz) {
  int64_t m = ma;
  for (; m + kRowTile <= mz; m += kRowTile) panels<F, kRowTile, 1>(pb, m, pa, pz);
  const bool cached = m > ma;
  switch (mz - m) {
    case 7: panels<F, 7, 1>(pb, m, pa, pz); break;
    case 6: panels<F, 6, 1>(pb, m, pa, pz); break;
    case 5: panels<F, 5, 1>(pb, m, pa, pz); break;
    case 4: cached ? panels<F, 4, 2>(pb, m, pa, pz) : panels<F, 4, 1>(pb, m, pa, pz); break;
    case 3: cached ? panels<F, 3, 2>(pb, m, pa, pz) : panels<F, 3, 1>(pb, m, pa, pz); break;
    case 2: cached ? panels<F, 2, 2>(pb, m, pa, pz) : panels<F, 2, 1>(pb, m, pa, pz); break;
    case 1: panels<F, 1, 1>(pb, m, pa, pz); break;
    default: break;
  }
}

// each row's sums of x over the 32-column blocks (q4_1's m term), one fixed order per row
void block_sums(const Problem& pb, float* out) {
  at::parallel_for(0, pb.m, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* x = pb.x + r * pb.lda;
      for (int64_t b = 0; b < pb.blocks; ++b) {
        const __m512i raw = _mm512_loadu_si512(x + b * kBlock);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        out[r * pb.blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      }
    }
  });
}

template <Format F>
void run(const Problem& pb) {
  for_each_block(pb, kRowTile, [&](int64_t ma, int64_t mz, int64_t pa, int64_t pz) { block<F>(pb, ma, mz, pa, pz); });
}

}  // namespace

void prefixkv::qgemm::run_format(Format f, Problem& pb, float* xsum) {
  if (f == Format::Q4_1) {
    block_sums(pb, xsum);
    pb.xsum = xsum;
  }
  switch (f) {
    case Format::Q8_0: run<Format::Q8_0>(pb); break;
    case Format::Q4_0: run<Format::Q4_0>(pb); break;
    case Format::Q4_1: run<Format::Q4_1>(pb); break;
  }
}

// x [M, K] bf16 (last dim contiguous), packed from qgemm_pack of N rows of K, bias [N] bf16 or none -> [M, N] bf16
at::Tensor qgemm(at::Tensor x, at::Tensor packed, int64_t n, std::string format, c10::optional<at::Tensor> bias) {
  const Format f = parse_format(format, "qgemm");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2, "qgemm: x must be bf16 [M, K]");
  TORCH_CHECK(n >= 0, "qgemm: n must be >= 0, got ", n);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(0) == panels_of(n) && packed.size(2) == panel_block_bytes(f) && packed.is_contiguous(),
              "qgemm: packed must come from qgemm_pack of an [n, K] ", format, " weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(1);
  TORCH_CHECK(k == blocks * kBlock, "qgemm: x has ", k, " columns, the weight ", blocks * kBlock);
  if (x.stride(1) != 1 || (x.stride(0) % 2 != 0 && m > 1)) x = x.contiguous();  // 4-byte aligned K pairs
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n, "qgemm: bias must be bf16 [N]");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  Problem pb{};
  pb.x = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  pb.lda = x.stride(0);
  pb.w = packed.data_ptr<uint8_t>();
  pb.blocks = blocks;
  pb.panel_bytes = blocks * panel_block_bytes(f);
  pb.m = m;
  const uint16_t* bias_ptr = b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr;
  pb.out = prefixkv::gemm::Problem{nullptr, 0, nullptr, 0, m, n, bias_ptr,
                                   reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), n};
  at::Tensor xsum = f == Format::Q4_1 ? at::empty({m, blocks}, x.options().dtype(at::kFloat)) : at::Tensor();
  run_format(f, pb, xsum.defined() ? xsum.data_ptr<float>() : nullptr);
  return y;
}

bool has_qgemm() { return true; }

#else

void prefixkv::qgemm::run_format(Format, Problem&, float*) {
  TORCH_CHECK(false, "qgemm needs AVX-512 BF16 (not compiled in)");
}

at::Tensor qgemm(at::Tensor, at::Tensor, int64_t, std::string, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "qgemm needs AVX-512 BF16 (not compiled in)");
}

bool has_qgemm() { return false; }

#endif
