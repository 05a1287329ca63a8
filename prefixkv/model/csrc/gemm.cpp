// bf16 matrix products y = x W^T (+ bias) whose every row is computed by one fixed sequence of instructions,
// whatever the number of rows in the call, the row's index in it or the thread count: the projections of
// cache-invariant bf16 (KernelOptions.cache_invariant, matmul path "avx512_bf16"; "avx2" on CPUs without AVX-512,
// below).
//
// Why our own: oneDNN picks its kernel, blocking and K split by the shape of the call, so a row can sum its
// products in another order inside a 2-row, a 33-row or a 200-row product (measured on Intel Xeon with AMX; on
// AMD Zen a one-row product differs). Then a token computed in a decode, a warm prefill or a cold one gets other
// bits, and a greedy answer can change on a cache hit. Here each output element is one chain of AVX512_BF16 dot
// products (vdpbf16ps) over the K pairs in order 0, 1, 2, ... into one float32 accumulator, then bias, then one
// rounding to bf16: no split K, no second accumulator, and the row tail is computed by the same per-row
// instructions as a full tile (a tile is only several independent chains side by side).
//
// Weight layout (gemm_pack, once at load): panels of 64 output columns, [panel][K pair][64 columns x 2 bf16], so
// one K pair of a panel is 4 vectors, 256 contiguous bytes; the last panel is zero-padded to 64 columns and an odd
// K to a whole pair. The AMX kernel (gemm_amx.cpp) reads the same layout: a B tile is 16 K pairs of one vector at
// a 256-byte stride. Tiles here are up to 6 rows x 64 columns (24 accumulators); with fewer rows a tile spans more
// panels, so that enough independent chains hide the dot-product latency.
#include "gemm.h"

#include <cstring>
#include <string>

namespace prefixkv::gemm {

Call prepare(const char* name, at::Tensor x, const at::Tensor& packed, int64_t n,
             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2, name, ": x must be bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 3 && packed.size(0) == panels_of(n) &&
                  packed.size(2) == kPairRow && packed.is_contiguous(),
              name, ": packed must come from gemm_pack of an [n, K] weight");
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(1);
  TORCH_CHECK((k + 1) / 2 == pairs, name, ": x has ", k, " columns, the weight ", 2 * pairs);
  if (x.stride(1) != 1 || k % 2 != 0 || (x.stride(0) % 2 != 0 && m > 1)) {
    // a whole K pair per 32-bit load, from 4-byte aligned rows: an odd K gets a zero column (the weight's padding
    // pair is zero too), so the chain is the same as for the unpadded row
    x = k % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1});
  }
  Call call;
  call.x = x;
  if (bias.has_value()) {
    call.bias = bias->contiguous();
    TORCH_CHECK(call.bias.scalar_type() == at::kBFloat16 && call.bias.numel() == n, name, ": bias must be bf16 [N]");
  }
  call.y = at::empty({m, n}, x.options());
  const at::BFloat16* bias_ptr = call.bias.defined() ? call.bias.data_ptr<at::BFloat16>() : nullptr;
  call.pb = Problem{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                    x.stride(0),
                    reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>()),
                    pairs,
                    m,
                    n,
                    reinterpret_cast<const uint16_t*>(bias_ptr),
                    reinterpret_cast<uint16_t*>(call.y.data_ptr<at::BFloat16>()),
                    n};
  return call;
}

}  // namespace prefixkv::gemm

using namespace prefixkv::gemm;

// weight [N, K] bf16 -> packed [panels, ceil(K / 2), 128] bf16 (int16 storage)
at::Tensor gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "gemm_pack: expected a bf16 CPU weight [out, in]");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), pairs = (k + 1) / 2, panels = panels_of(n);
  auto packed = at::zeros({panels, pairs, kPairRow}, weight.options().dtype(at::kShort));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* p = reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t c = 0; c < kPanel && panel * kPanel + c < n; ++c) {
        const uint16_t* src = w + (panel * kPanel + c) * k;
        uint16_t* dst = p + panel * pairs * kPairRow + 2 * c;
        for (int64_t kk = 0; kk < k; ++kk) dst[(kk / 2) * kPairRow + (kk % 2)] = src[kk];
      }
    }
  });
  return packed;
}

// weight [N, K] fp32 -> packed [panels, K, 64] fp32 (gemm_f32's layout: one K step of a panel is 256 contiguous
// bytes; the last panel zero-padded)
at::Tensor gemm_pack_f32(at::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "gemm_pack_f32: expected a float32 CPU weight [out, in]");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), panels = panels_of(n);
  auto packed = at::zeros({panels, k, kPanel}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t c = 0; c < kPanel && panel * kPanel + c < n; ++c)
        for (int64_t kk = 0; kk < k; ++kk) p[(panel * k + kk) * kPanel + c] = w[(panel * kPanel + c) * k + kk];
  });
  return packed;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
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

static void run_f32(const ProblemF32&) { TORCH_CHECK(false, "gemm_f32 is built with the AVX2 kernel only"); }
static constexpr bool kGemmF32 = false;
static constexpr const char* kGemmIsa = "avx512_bf16";

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (CPUs without AVX-512, such as AMD EPYC Zen 3): no bf16 dot product, so each K pair is two float32
// FMAs, the even element's then the odd one's, into one accumulator per output element. The same fixed chain
// for every row whatever M, as above (its bits differ from the AVX512_BF16 chain's, which rounds a pair once).
// Weights stay in the shared panel layout; a tile is R rows x half a panel (32 columns, 4 vectors of 8), so its
// 4R accumulators, the pair's two converted vectors and the rows' broadcasts fit the 16 ymm registers.
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

#else

namespace prefixkv::gemm {
void run(const Problem&) { TORCH_CHECK(false, "gemm needs AVX-512 BF16 or AVX2 + FMA (not compiled in)"); }
}  // namespace prefixkv::gemm

static void run_f32(const ProblemF32&) { TORCH_CHECK(false, "gemm_f32 is built with the AVX2 kernel only"); }
static constexpr bool kGemmF32 = false;
static constexpr const char* kGemmIsa = "";

#endif

// x [M, K] bf16 (last dim contiguous), packed from gemm_pack of a [N, K] weight, bias [N] bf16 or none -> [M, N]
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(kGemmIsa[0] != '\0', "gemm needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
  Call call = prepare("gemm", std::move(x), packed, n, bias);
  run(call.pb);
  return call.y;
}

bool has_gemm() { return kGemmIsa[0] != '\0'; }

// x [M, K] fp32, packed from gemm_pack_f32 of a [N, K] weight, bias [N] fp32 or none -> [M, N] fp32
at::Tensor gemm_f32(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(kGemmF32, "gemm_f32 is built with the AVX2 kernel only (a CPU without AVX-512)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "gemm_f32: x must be fp32 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(0) == panels_of(n) &&
                  packed.size(2) == kPanel && packed.is_contiguous(),
              "gemm_f32: packed must come from gemm_pack_f32 of an [n, K] weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k, "gemm_f32: x has ", k, " columns, the weight ", packed.size(1));
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "gemm_f32: bias must be fp32 [N]");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  run_f32(ProblemF32{x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), k, m, n,
                     b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), n});
  return y;
}

bool has_gemm_f32() { return kGemmF32; }

// the instruction set the product is compiled for (the matmul path's name), or "" without one
std::string gemm_isa() { return kGemmIsa; }
