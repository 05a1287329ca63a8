// The row-invariant bf16 matrix product of gemm.cpp on Intel AMX tiles (matmul path "amx"): same packed weights,
// same contract (a row's bits never depend on the rows beside it), 8-16x the multiply rate of AVX512_BF16.
//
// Every output element is one chain of tdpbf16ps over the K blocks in order (32 K values per instruction) into
// one float32 tile element that starts at zero, then bias, then one rounding to bf16. A tile computes each of its
// rows from that row of A alone, so a row's result does not depend on which other rows share its tile, and rows
// of a tail tile (fewer than 16 or 32 left) are copied into a zero-padded buffer and run through the same
// instructions. Weights whose K is not a multiple of 32 (no whole A tile) run gemm.cpp's AVX512_BF16 chains
// instead, always, so the choice depends on the weight only.
//
// Tiles: with more than 16 rows, 32 rows x 32 columns per step (C in tmm0-3, A in tmm4-5, B in tmm6-7: 4 loads for
// 4 products); up to 16 rows (decodes), 16 rows x 64 columns (C in tmm0-3, A in tmm4, B rotating in tmm5-7).
// The same kernels run on emulated tiles (amx.h's EmuTiles) for the tests of machines without AMX.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "../amx.h"
#include "../gemm.h"

namespace prefixkv {

bool amx_supported() {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool bf16 = d & (1u << 22), tile = d & (1u << 24);
    if (!bf16 || !tile) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux: ask for the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return supported;
}

}  // namespace prefixkv

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

using namespace prefixkv::gemm;

namespace prefixkv::gemm {
void avx512_block(const Problem& pb, int64_t ma, int64_t mz, int64_t pa, int64_t pz);  // avx512_bf16.h
}

namespace {

constexpr int64_t kBlockPairs = 16;        // K pairs per tdpbf16ps (32 K values: one 64-byte A tile row)
constexpr int64_t kBStride = kPairRow * 2;  // bytes between a B tile's rows (consecutive K pairs of a panel)

// rows [0, rows) x columns [0, cols) of the float32 tile results c (row stride ldc floats) -> y rows from m0,
// columns from col0 (those < n), plus bias, rounded to bf16
void store_rows(const Problem& pb, const float* c, int64_t ldc, int64_t m0, int64_t rows, int64_t col0, int64_t cols) {
  for (int64_t j = 0; j < cols; j += 16) {
    const int64_t col = col0 + j;
    if (col >= pb.n) break;
    const Columns16 columns = columns16(pb, col);
    for (int64_t r = 0; r < rows; ++r) store16(pb, columns, m0 + r, col, _mm512_loadu_ps(c + r * ldc + j));
  }
}

// 32 rows of A (a, row stride lda elements) x columns [16 v0, 16 v0 + 32) of panel p -> c [32][32] floats
template <class T>
void tiles_2x2(const Problem& pb, const uint16_t* a, int64_t lda, int64_t p, int64_t v0, float* c) {
  T::template zero<0>();
  T::template zero<1>();
  T::template zero<2>();
  T::template zero<3>();
  const uint16_t* b = pb.panel(p) + v0 * 32;
  const int64_t blocks = pb.pairs / kBlockPairs;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    T::template load<4>(a + kb * 32, lda * 2);
    T::template load<5>(a + 16 * lda + kb * 32, lda * 2);
    T::template load<6>(b + kb * kBlockPairs * kPairRow, kBStride);
    T::template load<7>(b + kb * kBlockPairs * kPairRow + 32, kBStride);
    T::template dot<0, 4, 6>();
    T::template dot<1, 4, 7>();
    T::template dot<2, 5, 6>();
    T::template dot<3, 5, 7>();
  }
  T::template store<0>(c, 32 * 4);
  T::template store<1>(c + 16, 32 * 4);
  T::template store<2>(c + 16 * 32, 32 * 4);
  T::template store<3>(c + 16 * 32 + 16, 32 * 4);
}

// 16 rows of A x the 64 columns of panel p -> c [16][64] floats
template <class T>
void tiles_1x4(const Problem& pb, const uint16_t* a, int64_t lda, int64_t p, float* c) {
  T::template zero<0>();
  T::template zero<1>();
  T::template zero<2>();
  T::template zero<3>();
  const uint16_t* b = pb.panel(p);
  const int64_t blocks = pb.pairs / kBlockPairs;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const uint16_t* bk = b + kb * kBlockPairs * kPairRow;
    T::template load<4>(a + kb * 32, lda * 2);
    T::template load<5>(bk, kBStride);
    T::template dot<0, 4, 5>();
    T::template load<6>(bk + 32, kBStride);
    T::template dot<1, 4, 6>();
    T::template load<7>(bk + 64, kBStride);
    T::template dot<2, 4, 7>();
    T::template load<5>(bk + 96, kBStride);
    T::template dot<3, 4, 5>();
  }
  T::template store<0>(c, 64 * 4);
  T::template store<1>(c + 16, 64 * 4);
  T::template store<2>(c + 32, 64 * 4);
  T::template store<3>(c + 48, 64 * 4);
}

// Rows [ma, mz) x panels [pa, pz) on tiles: 32-row steps, a tail of up to 16 rows by the 16-row step; a step
// with fewer rows than its tiles reads them from a zero-padded copy
template <class T>
void amx_block(const Problem& pb, int64_t ma, int64_t mz, int64_t pa, int64_t pz) {
  T::configure(prefixkv::full_tiles());
  const int64_t k = 2 * pb.pairs;
  std::vector<uint16_t> padded;
  alignas(64) float c[32 * 64];
  for (int64_t m = ma; m < mz;) {
    const int64_t rows = std::min<int64_t>(mz - m, 32);
    const int64_t step = rows > 16 ? 32 : 16;
    const uint16_t* a = pb.x + m * pb.lda;
    int64_t lda = pb.lda;
    if (rows < step) {
      padded.assign(step * k, 0);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(padded.data() + r * k, a + r * pb.lda, k * 2);
      a = padded.data();
      lda = k;
    }
    for (int64_t p = pa; p < pz; ++p) {
      if (step == 32) {
        for (int64_t v0 = 0; v0 < kVecs; v0 += 2) {
          tiles_2x2<T>(pb, a, lda, p, v0, c);
          store_rows(pb, c, 32, m, rows, p * kPanel + v0 * 16, 32);
        }
      } else {
        tiles_1x4<T>(pb, a, lda, p, c);
        store_rows(pb, c, 64, m, rows, p * kPanel, 64);
      }
    }
    m += rows;
  }
  T::release();
}

template <class T>
void run_on(const Problem& pb) {
  const bool whole_blocks = pb.pairs % kBlockPairs == 0;
  for_each_block(pb, whole_blocks ? 32 : 6, [&](int64_t ma, int64_t mz, int64_t pa, int64_t pz) {
    if (whole_blocks)
      amx_block<T>(pb, ma, mz, pa, pz);
    else
      avx512_block(pb, ma, mz, pa, pz);
  });
}

template <class T>
at::Tensor amx_gemm_on(const char* name, at::Tensor x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  Call call = prepare(name, std::move(x), packed, n, bias);
  run_on<T>(call.pb);
  return call.y;
}

}  // namespace

namespace prefixkv::gemm {
void run_amx(const Problem& pb) { run_on<prefixkv::HwTiles>(pb); }
}  // namespace prefixkv::gemm

// gemm's contract on AMX tiles; an error where the CPU or the OS does not offer them
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(prefixkv::amx_supported(), "amx_gemm: this CPU or OS does not offer AMX tiles (see has_amx)");
  return amx_gemm_on<prefixkv::HwTiles>("amx_gemm", std::move(x), packed, n, bias);
}

// amx_gemm's kernels on emulated tiles (any AVX512_BF16 CPU): tests of the layout, blocking and tails
at::Tensor amx_gemm_emulated(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  return amx_gemm_on<prefixkv::EmuTiles>("amx_gemm_emulated", std::move(x), packed, n, bias);
}

bool has_amx() { return prefixkv::amx_supported(); }

#else

namespace prefixkv::gemm {
void run_amx(const Problem&) { TORCH_CHECK(false, "amx_gemm needs AVX-512 BF16 (not compiled in)"); }
}  // namespace prefixkv::gemm

at::Tensor amx_gemm(at::Tensor, at::Tensor, int64_t, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "amx_gemm needs AVX-512 BF16 (not compiled in)");
}

at::Tensor amx_gemm_emulated(at::Tensor, at::Tensor, int64_t, c10::optional<at::Tensor>) {
  TORCH_CHECK(false, "amx_gemm_emulated needs AVX-512 BF16 (not compiled in)");
}

bool has_amx() { return false; }

#endif
