// Intel AMX tiles for prefixkv's kernels: the hardware instructions, and a software copy of them.
//
// Kernels are templates over a Tiles policy with the same static functions: HwTiles runs the instructions
// (tileloadd, tdpbf16ps, ...), EmuTiles computes what they compute in scalar code. The hardware copy runs only
// where the CPU has AMX (amx_supported()); the emulated copy runs anywhere, so that the kernels' data layout,
// blocking and tails are tested on every machine, AMX or not (what it cannot show is the hardware's own rounding).
//
// The instructions are written as inline assembly (with "memory" clobbers, which GCC's own tile macros lack:
// without them a store into a buffer may be moved after the tile load that reads it), so no compiler flag is
// needed to build them on a CPU without AMX.
#pragma once

#include <cstdint>
#include <cstring>

namespace prefixkv {

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each of the 8 tile registers
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Every tile register 16 rows x 64 bytes: the only shape prefixkv's kernels use (A: 16 rows x 32 bf16; B: 16 K
// pairs x 16 columns x 2 bf16; C: 16 rows x 16 float32)
inline TileConfig full_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

// Whether this process may use AMX: the CPU has AMX-TILE and AMX-BF16 and Linux granted the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, once per process). Defined in gemm/gemm_amx.cpp.
bool amx_supported();

#define PREFIXKV_TILE_SWITCH(t, MACRO, ...) \
  if constexpr (t == 0) MACRO(0, __VA_ARGS__); \
  else if constexpr (t == 1) MACRO(1, __VA_ARGS__); \
  else if constexpr (t == 2) MACRO(2, __VA_ARGS__); \
  else if constexpr (t == 3) MACRO(3, __VA_ARGS__); \
  else if constexpr (t == 4) MACRO(4, __VA_ARGS__); \
  else if constexpr (t == 5) MACRO(5, __VA_ARGS__); \
  else if constexpr (t == 6) MACRO(6, __VA_ARGS__); \
  else MACRO(7, __VA_ARGS__)
#define PREFIXKV_TILELOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define PREFIXKV_TILESTORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define PREFIXKV_TILEZERO(t, unused) asm volatile("tilezero %%tmm" #t ::)

struct HwTiles {
  static void configure(const TileConfig& c) { asm volatile("ldtilecfg %0" ::"m"(c) : "memory"); }
  static void release() { asm volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    PREFIXKV_TILE_SWITCH(T, PREFIXKV_TILELOAD, base, stride);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    PREFIXKV_TILE_SWITCH(T, PREFIXKV_TILESTORE, base, stride);
  }
  template <int T>
  static void zero() {
    PREFIXKV_TILE_SWITCH(T, PREFIXKV_TILEZERO, 0);
  }
  // C += A . B (tdpbf16ps: every C element a float32 sum of its A row's bf16 pairs times its B column's)
  template <int C, int A, int B>
  static void dot() {
    static_assert(C < 8 && A < 8 && B < 8, "8 tile registers");
    asm volatile("tdpbf16ps %%tmm%c[b], %%tmm%c[a], %%tmm%c[c]" ::[a] "i"(A), [b] "i"(B), [c] "i"(C));
  }
};

// What the instructions compute, in scalar code: the registers are this thread's arrays
struct EmuTiles {
  struct State {
    TileConfig config;
    alignas(64) uint8_t data[8][16 * 64];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void configure(const TileConfig& c) {
    state().config = c;
    std::memset(state().data, 0, sizeof(state().data));
  }
  static void release() {}
  template <int T>
  static void load(const void* base, int64_t stride) {
    State& s = state();
    std::memset(s.data[T], 0, sizeof(s.data[T]));
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(s.data[T] + r * 64, static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[T] + r * 64, s.config.colsb[T]);
  }
  template <int T>
  static void zero() {
    std::memset(state().data[T], 0, sizeof(state().data[T]));
  }
  static float bf16(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
  }
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    float* c = reinterpret_cast<float*>(s.data[C]);
    const uint16_t* a = reinterpret_cast<const uint16_t*>(s.data[A]);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(s.data[B]);
    const int rows = s.config.rows[C], cols = s.config.colsb[C] / 4, pairs = s.config.colsb[A] / 4;
    for (int m = 0; m < rows; ++m)
      for (int k = 0; k < pairs; ++k)
        for (int n = 0; n < cols; ++n) {
          float& acc = c[m * 16 + n];
          acc += bf16(a[m * 32 + 2 * k]) * bf16(b[k * 32 + 2 * n]);
          acc += bf16(a[m * 32 + 2 * k + 1]) * bf16(b[k * 32 + 2 * n + 1]);
        }
  }
};

}  // namespace prefixkv
