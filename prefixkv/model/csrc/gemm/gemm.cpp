// bf16 matrix products y = x W^T (+ bias) whose every row is computed by one fixed sequence of instructions,
// whatever the number of rows in the call, the row's index in it or the thread count: the projections of
// cache-invariant bf16 (KernelOptions.cache_invariant, matmul path "avx512_bf16"; "avx2" on CPUs without AVX-512:
// avx2.h).
//
// Why our own: oneDNN picks its kernel, blocking and K split by the shape of the call, so a row can sum its
// products in another order inside a 2-row, a 33-row or a 200-row product (measured on Intel Xeon with AMX; on
// AMD Zen a one-row product differs). Then a token computed in a decode, a warm prefill or a cold one gets other
// bits, and a greedy answer can change on a cache hit. Here each output element is one chain of AVX512_BF16 dot
// products (vdpbf16ps) over the K pairs in order 0, 1, 2, ... into one float32 accumulator, then bias, then one
// rounding to bf16: no split K, no second accumulator, and the row tail is computed by the same per-row
// instructions as a full tile (a tile is only several independent chains side by side).
// This file holds what both vector builds share (the checks, the packing, the entry points); the inner loops are
// avx512_bf16.h and avx2.h beside it, headers of this translation unit (the same code as one file, so the same
// bits); csrc/README.md maps CPUs to them.
//
// Weight layout (gemm_pack, once at load): panels of 64 output columns, [panel][K pair][64 columns x 2 bf16], so
// one K pair of a panel is 4 vectors, 256 contiguous bytes; the last panel is zero-padded to 64 columns and an odd
// K to a whole pair. The AMX kernel (gemm_amx.cpp) reads the same layout: a B tile is 16 K pairs of one vector at
// a 256-byte stride. Tiles here are up to 6 rows x 64 columns (24 accumulators); with fewer rows a tile spans more
// panels, so that enough independent chains hide the dot-product latency.
#include "../gemm.h"

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

// the build's bf16 inner loops: each defines run and kGemmIsa
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include "avx512_bf16.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
#else
namespace prefixkv::gemm {
void run(const Problem&) { TORCH_CHECK(false, "gemm needs AVX-512 BF16 or AVX2 + FMA (not compiled in)"); }
}  // namespace prefixkv::gemm
static constexpr const char* kGemmIsa = "";
#endif

// the float32 product: run_f32 and kGemmF32, wherever AVX2 + FMA run (AVX-512 builds too)
#if defined(__AVX2__) && defined(__FMA__)
#include "f32_avx2.h"
#else
static void run_f32(const ProblemF32&) { TORCH_CHECK(false, "gemm_f32 needs AVX2 + FMA (not compiled in)"); }
static constexpr bool kGemmF32 = false;
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
  TORCH_CHECK(kGemmF32, "gemm_f32 needs AVX2 + FMA (not compiled in)");
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
