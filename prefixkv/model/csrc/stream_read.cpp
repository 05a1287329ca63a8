// A read-only pass over a buffer on every intra-op thread: what the machine's memory gives a weight stream.
//
// Why: `prefixkv bench decode` puts a decode step against the time to read its weights once at the measured
// bandwidth. torch's bf16 sum, the other read it times, converts and adds as it reads and measured 53-58 GB/s
// where this loop read 74-79 GB/s on the same 2-core AMD EPYC VM in the same minute, so a floor from it alone
// would be too low. Each thread reads one contiguous share with 64-byte loads, four independent lines per
// iteration, and folds them into a checksum so the loads cannot be dropped.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// buf: any contiguous CPU tensor; returns an xor of its 64-bit words (the checksum; meaningless but kept)
int64_t stream_read(const at::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous(), "stream_read: expected a contiguous CPU tensor");
  const char* base = static_cast<const char*>(buf.data_ptr());
  const int64_t lines = buf.numel() * buf.element_size() / 256;  // whole 256-byte groups; a tail is not read
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<uint64_t> sums(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = lines * t / threads, last = lines * (t + 1) / threads;
      uint64_t sum = 0;
#if defined(__AVX512F__)
      __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
      for (int64_t i = first; i < last; ++i) {
        const char* p = base + i * 256;
        a = _mm512_xor_si512(a, _mm512_loadu_si512(p));
        b = _mm512_xor_si512(b, _mm512_loadu_si512(p + 64));
        c = _mm512_xor_si512(c, _mm512_loadu_si512(p + 128));
        d = _mm512_xor_si512(d, _mm512_loadu_si512(p + 192));
      }
      const __m512i folded = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
      alignas(64) uint64_t lanes[8];
      _mm512_store_si512(lanes, folded);
      for (uint64_t lane : lanes) sum ^= lane;
#else
      for (int64_t i = first * 32; i < last * 32; ++i) {
        uint64_t word;
        std::memcpy(&word, base + i * 8, 8);
        sum ^= word;
      }
#endif
      sums[t] = sum;
    }
  });
  uint64_t all = 0;
  for (uint64_t s : sums) all ^= s;
  return static_cast<int64_t>(all);
}
