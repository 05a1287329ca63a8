// The attention kernels' shared driver: the two entry points, their work split and per-thread row state, the
// per-head_dim dispatchers the bindings call, and which per-ISA inner loops this build runs (Path::of). The inner
// loops (packing K / V, the chunk routine, the row finish) are in one file per instruction set, beside this one;
// csrc/README.md maps CPUs to them.
//
// One head_dim per translation unit: this file builds head_dim 64 (PREFIXKV_HEAD_DIM unset) and
// flash_attention_d128.cpp includes it again for 128. Each build's entry points carry the dim in their names
// (flash_attention_d64, ...); the 64 build also holds the dispatchers the bindings call, which pick the build from
// the query's last dim. Every loop over the head's dims runs in whole 32- or 64-dim blocks in the same order, so
// the 64 build computes what it did before the dim became a parameter, bit for bit.
// Two entry points share one arithmetic:
// - flash_attention: many query rows against one key range (a prefill chunk, fresh or after cached tokens; the
//   stacked queries of several chunks or decodes against a shared prefix);
// - paged_flash_decode: one query token per sequence, each over its own pages.
// Both return each row's log-sum-exp (to merge pieces over disjoint key ranges) and can hand over / pick up the
// raw online-softmax state instead, so attention over keys [0, P) then [P, L) continues exactly where one pass
// over [0, L) would be after key P (bit for bit when P is a multiple of kChunk): that is how shared prefixes are
// attended once without changing any row's result (cache-invariant bf16, see KernelOptions.cache_invariant).
//
// Why one arithmetic: a token's attention must not depend on whether its context was computed this step or read
// from the cache, nor on how the scheduler cut the prompt into chunks (a 1-token chunk runs as a decode). Every
// row therefore walks its keys from key 0 in chunks of kChunk, and one compiled function (attend_chunk) does a
// tile of rows against one chunk for both entry points.
//
// Why a kernel at all: torch's CPU flash kernel reaches ~60-120 GFLOPS on SmolLM2's shapes (3 kv heads of 64, 9
// query heads), under a third of what the same CPU does in the model's matmuls.
// Work items are (kv head, block of query positions) or (sequence, kv head); the query heads of a kv head share
// its packed K/V (GQA without expanding): once per call for flash_attention, chunk by chunk for decodes.
//
// The per-ISA files are headers of this translation unit, not separate ones, so each build compiles exactly the
// code it did as one file (the same inlining, so the same bits). The AMX and vector paths round differently
// from each other, and an engine uses one of them throughout (KernelOptions.amx_attention).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../flash_attention.h"

#ifndef PREFIXKV_HEAD_DIM
#define PREFIXKV_HEAD_DIM 64
#endif
#define PREFIXKV_CAT2(a, b) a##b
#define PREFIXKV_CAT(a, b) PREFIXKV_CAT2(a, b)
#define PREFIXKV_PER_DIM(name) PREFIXKV_CAT(name##_d, PREFIXKV_HEAD_DIM)  // flash_attention -> flash_attention_d64

#if PREFIXKV_HEAD_DIM == 64
void prefixkv::attention::check_pages(const at::Tensor& table, const at::Tensor& lens, int64_t rows,
                                      int64_t page_size, const char* who) {
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && table.is_contiguous() &&
                  lens.is_contiguous(),
              who, ": table / lens must be contiguous int64");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == rows && lens.numel() == rows, who,
              ": one table row and length per sequence");
  TORCH_CHECK(page_size >= 1, who, ": page_size must be >= 1");
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(len[r] >= 1 && len[r] <= table.size(1) * page_size, who,
                ": each length must be in [1, pages * page_size]");
}
#endif

// the build's instruction set: the vector path (isa 0) and, in AVX-512 builds, the AMX kernels (isa 1, 2)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PREFIXKV_ATTENTION_ISA "avx512_bf16"
#elif defined(__AVX2__) && defined(__FMA__)
#define PREFIXKV_ATTENTION_ISA "avx2"
#endif

#ifdef PREFIXKV_ATTENTION_ISA
#include "rows.h"
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include "avx512_bf16.h"
#include "amx.h"

Path Path::of(int64_t isa) {
  switch (isa) {
    case kAmx:
      TORCH_CHECK(prefixkv::amx_supported(), "native attention: this CPU or OS does not offer AMX tiles");
      return {&attend_chunk_amx<prefixkv::HwTiles>, kAmxTile,
              [] { prefixkv::HwTiles::configure(prefixkv::full_tiles()); }, [] { prefixkv::HwTiles::release(); }};
    case kAmxEmulated:
      return {&attend_chunk_amx<prefixkv::EmuTiles>, kAmxTile,
              [] { prefixkv::EmuTiles::configure(prefixkv::full_tiles()); }, [] {}};
    default:
      TORCH_CHECK(isa == kVector, "native attention: isa must be 0 (AVX-512), 1 (AMX) or 2 (emulated AMX)");
      return {&attend_chunk, kTile, [] {}, [] {}};
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"

// no tiles to set up here
Path Path::of(int64_t isa) {
  TORCH_CHECK(isa == kVector, "native attention: this build (AVX2, no AVX-512) runs isa 0 only; AMX needs AVX-512");
  return {&attend_chunk, kTile, [] {}, [] {}};
}

#endif

#ifdef PREFIXKV_ATTENTION_ISA
namespace {

// Per-thread storage of a work item's row state
struct RowStorage {
  std::vector<float> o_state, m, l, scores, q_float;
  std::vector<int64_t> see;
  std::vector<const uint32_t*> q;
  std::vector<uint16_t> q_rows;
  std::vector<uint32_t> probs;
  Rows rows;

  template <class T>
  static T* aligned(std::vector<T>& v) {
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
  }

  // amx: also the AMX buffers (queries copied, a tile's scores and probabilities); an AVX2 build also widens
  // the queries
  RowStorage(int64_t max_rows, bool amx)
      : o_state(max_rows * kDim + 16),
        m(max_rows),
        l(max_rows),
        scores(amx ? kAmxTile * kChunk + 16 : 0),
        q_float(kFloatQueries ? max_rows * kDim + 16 : 0),
        see(max_rows),
        q(max_rows),
        q_rows(amx ? max_rows * kDim + 32 : 0),
        probs(amx ? kAmxTile * kChunk / 2 + 16 : 0) {
    rows = Rows{q.data(),
                see.data(),
                m.data(),
                l.data(),
                aligned(o_state),
                amx ? aligned(q_rows) : nullptr,
                amx ? aligned(scores) : nullptr,
                amx ? aligned(probs) : nullptr,
                kFloatQueries ? aligned(q_float) : nullptr};
  }

  // row r's query: pointed to, for AMX copied into the row-after-row block, for an AVX2 build widened
  void set_query(int64_t r, const uint16_t* query) {
    rows.q[r] = reinterpret_cast<const uint32_t*>(query);
    if (rows.q_rows != nullptr) std::memcpy(rows.q_rows + r * kDim, query, kDim * sizeof(uint16_t));
    if (rows.qf != nullptr)
      for (int64_t d = 0; d < kDim; ++d) rows.qf[r * kDim + d] = bf16_to_float(query[d]);
  }
};

// One thread's scratch for the items it takes: row state and buffers, a chunk of packed K and V (decodes), and
// the tiles set up for the path
struct Scratch {
  RowStorage storage;
  const Path& path;
  std::vector<Packed> chunk;

  Scratch(int64_t max_rows, const Path& p, bool amx, bool decode = false)
      : storage(max_rows, amx), path(p), chunk(decode ? 2 * kChunk * kDim + 64 : 0) {
    path.begin();
  }
  Packed* keys() { return RowStorage::aligned(chunk); }
  Packed* values() { return keys() + kChunk * kDim; }
  ~Scratch() { path.end(); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

at::Tensor checked_state(const c10::optional<at::Tensor>& state, int64_t rows, int64_t heads) {
  if (!state.has_value()) return at::Tensor();
  const at::Tensor& s = *state;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == rows && s.size(1) == heads &&
                  s.size(2) == kStateWidth,
              "state must be float32 [rows, heads, head_dim + 2] (as returned with return_state)");
  return s.contiguous();
}

void check_inputs(const at::Tensor& q, const at::Tensor& kv) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "native attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16, "native attention is bf16");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kDim && kv.dim() == 4 && kv.size(0) == 2 && kv.size(3) == kDim &&
                  kv.stride(3) == 1,
              "expected q [R, H, D] and kv [2, KVH, slots, D], D = ", kDim);
  TORCH_CHECK(q.size(1) % kv.size(1) == 0, "query heads must be a multiple of kv heads");
}

}  // namespace

// q [R, H, 64] bf16; kv [2, KVH, S, 64] bf16 (last dim contiguous); slots [L] int64: slot of key j; q_pos [R]
// int64: row r sees keys j <= q_pos[r] (and j < L). Every row must see key 0. state_in [R, H, 66] float32: start
// from this state (keys before these L, as returned with return_state) instead of from nothing. Returns {out
// [R, H, 64] bf16, lse [R, H] float32 (natural log of the sum of exp(scale * score))} and, with return_state,
// the state [R, H, 66]. isa: 0 AVX512_BF16 dot products, 1 AMX tiles, 2 AMX kernels on emulated tiles (tests).
std::vector<at::Tensor> PREFIXKV_PER_DIM(flash_attention)(at::Tensor q, at::Tensor kv, at::Tensor slots,
                                                          at::Tensor q_pos, double scale,
                                                          c10::optional<at::Tensor> state_in, bool return_state,
                                                          int64_t isa) {
  check_inputs(q, kv);
  const Path path = Path::of(isa);
  TORCH_CHECK(slots.scalar_type() == at::kLong && q_pos.scalar_type() == at::kLong, "slots / q_pos must be int64");
  TORCH_CHECK(q_pos.size(0) == q.size(0), "one q_pos per query row");
  q = q.contiguous();
  slots = slots.contiguous();
  q_pos = q_pos.contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = kv.size(1), group = heads / kv_heads;
  const at::Tensor state0 = checked_state(state_in, rows, heads);
  const int64_t length = slots.size(0);
  TORCH_CHECK(length >= 1, "flash_attention needs at least one key");
  // keys rounded up to whole vectors (and to even pairs); to whole 64-key chunks for AMX, whose tiles read them
  const int64_t key_unit = isa == kVector ? kKeysPerVec : kChunk;
  const int64_t padded = (length + key_unit - 1) / key_unit * key_unit;
  const int64_t groups16 = padded / kKeysPerVec;
  auto out = at::empty_like(q);
  auto lse = at::empty({rows, heads}, q.options().dtype(at::kFloat));
  auto state = return_state ? at::empty({rows, heads, kStateWidth}, q.options().dtype(at::kFloat)) : at::Tensor();
  auto kp = at::empty({kv_heads, padded * kDim}, q.options().dtype(kPackedType));
  auto vp = at::empty({kv_heads, padded * kDim}, q.options().dtype(kPackedType));
  const uint16_t* kv_ptr = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  const int64_t kv_stride = kv.stride(0), head_stride = kv.stride(1), slot_stride = kv.stride(2);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t* pos_ptr = q_pos.data_ptr<int64_t>();
  Packed* kp_ptr = static_cast<Packed*>(kp.data_ptr());
  Packed* vp_ptr = static_cast<Packed*>(vp.data_ptr());
  const int64_t kp_head = padded * kDim, vp_head = padded * kDim;  // either layout: 64 elements per key

  prefixkv::parallel_items(kv_heads * groups16, [&](int64_t item) {
    const int64_t h = item / groups16, g16 = item % groups16;
    pack_keys(kv_ptr + h * head_stride, slot_stride, slot_ptr, length, g16, kp_ptr + h * kp_head);
    for (int64_t pair = g16 * 8; pair < g16 * 8 + 8; ++pair)
      pack_values(kv_ptr + kv_stride + h * head_stride, slot_stride, slot_ptr, length, pair, vp_ptr + h * vp_head);
  });

  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  float* lse_ptr = lse.data_ptr<float>();
  const float* state_in_ptr = state0.defined() ? state0.data_ptr<float>() : nullptr;
  float* state_ptr = return_state ? state.data_ptr<float>() : nullptr;
  // query positions per work item: more share each key chunk while it is in L1, fewer balance short calls
  const int64_t kBlockPositions = rows >= 1024 ? 64 : 16;
  const int64_t blocks = (rows + kBlockPositions - 1) / kBlockPositions;
  const float fscale = static_cast<float>(scale);

  // items are taken from the end: each head's last blocks, which see the most keys, first, so that no thread is
  // left with a long one at the end
  const int64_t items = kv_heads * blocks;
  auto scratch = [&] { return Scratch(kBlockPositions * group + path.tile, path, isa != kVector); };
  prefixkv::parallel_items(items, scratch, [&](Scratch& thread, int64_t i) {
    RowStorage& storage = thread.storage;
    const Rows& st = storage.rows;
    const int64_t item = items - 1 - i;
    const int64_t h = item / blocks, block = item % blocks;
    const int64_t first = block * kBlockPositions, last = std::min(rows, first + kBlockPositions);
    const int64_t item_rows = (last - first) * group;  // rows (position, query head of this kv head)
    const int64_t padded_rows = (item_rows + path.tile - 1) / path.tile * path.tile;
    const Packed* khead = kp_ptr + h * kp_head;
    const Packed* vhead = vp_ptr + h * vp_head;
    int64_t see_max = 0;
    for (int64_t r = 0; r < padded_rows; ++r) {
      const int64_t rr = std::min(r, item_rows - 1);  // padding rows repeat the last real one
      const int64_t pos = first + rr / group, head = h * group + rr % group;
      storage.set_query(r, q_ptr + (pos * heads + head) * kDim);
      st.see[r] = std::min(pos_ptr[pos], length - 1);
      see_max = std::max(see_max, st.see[r]);
      init_row(st, r, state_in_ptr == nullptr ? nullptr : state_in_ptr + (pos * heads + head) * kStateWidth);
    }
    for (int64_t c0 = 0; c0 <= see_max; c0 += kChunk) {
      const Packed* kc = khead + c0 * kDim;
      const Packed* vc = vhead + c0 * kDim;
      for (int64_t t0 = 0; t0 < padded_rows; t0 += path.tile) path.attend(kc, vc, c0, t0, st, fscale);
    }
    for (int64_t r = 0; r < item_rows; ++r) {
      const int64_t idx = (first + r / group) * heads + h * group + r % group;
      float* row_state = state_ptr == nullptr ? nullptr : state_ptr + idx * kStateWidth;
      finish_row(st, r, out_ptr + idx * kDim, lse_ptr + idx, row_state);
    }
  });
  if (return_state) return {out, lse, state};
  return {out, lse};
}

// q [B, H, 64] bf16, one query token per sequence; kv as for flash_attention; table [B, max_pages] int64 page
// ids; lens [B] int64: sequence b attends to its positions [0, lens[b]) (>= 1). Bit for bit what flash_attention
// computes for that row over the same keys (its slots in position order, q_pos = lens[b] - 1). state_in /
// return_state as for flash_attention.
void prefixkv::attention::PREFIXKV_PER_DIM(paged_decode)(const PagedDecode& a, int64_t isa) {
  const Path path = Path::of(isa);
  const int64_t group = a.heads / a.kv_heads;
  // sequences come shortest first (the planner sorts decodes by length): taken from the end, longest first
  const int64_t items = a.batch * a.kv_heads;
  const int64_t padded_rows = (group + path.tile - 1) / path.tile * path.tile;
  auto scratch = [&] { return Scratch(padded_rows, path, isa != kVector, /*decode=*/true); };
  prefixkv::parallel_items(items, scratch, [&](Scratch& thread, int64_t i) {
    RowStorage& storage = thread.storage;
    const Rows& st = storage.rows;
    Packed *kc = thread.keys(), *vc = thread.values();
    const int64_t item = items - 1 - i;
    const int64_t b = item / a.kv_heads, h = item % a.kv_heads, len = a.lens[b];
    const int64_t* pages = a.table + b * a.max_pages;
    for (int64_t r = 0; r < padded_rows; ++r) {
      const int64_t head = h * group + std::min(r, group - 1);  // padding rows repeat the last real one
      storage.set_query(r, a.q + b * a.q_row_stride + head * kDim);
      st.see[r] = len - 1;
      init_row(st, r, a.state_in == nullptr ? nullptr : a.state_in + (b * a.heads + head) * kStateWidth);
    }
    int64_t slots[kChunk];
    for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
      // the vectors holding keys; AMX tiles read the whole chunk (zeros past the sequence)
      const int64_t nvec = isa == kVector ? std::min<int64_t>(4, (len - 1 - c0) / kKeysPerVec + 1) : 4;
      chunk_slots(pages, a.page_size, c0, std::min(kChunk, len - c0), slots);
      pack_chunk_keys(a.kv + h * a.head_stride, a.slot_stride, slots, c0, len, nvec, kc);
      pack_chunk_values(a.kv + a.kv_stride + h * a.head_stride, a.slot_stride, slots, c0, len, nvec * 8, vc);
      for (int64_t t0 = 0; t0 < padded_rows; t0 += path.tile) path.attend(kc, vc, c0, t0, st, a.scale);
    }
    for (int64_t r = 0; r < group; ++r) {
      const int64_t idx = b * a.heads + h * group + r;
      float* row_state = a.state == nullptr ? nullptr : a.state + idx * kStateWidth;
      finish_row(st, r, a.out + idx * kDim, a.lse + idx, row_state);
    }
  });
}

// q [B, H, 64] bf16, one query token per sequence; kv as for flash_attention; table [B, max_pages] int64 page
// ids; lens [B] int64: sequence b attends to its positions [0, lens[b]) (>= 1). Bit for bit what flash_attention
// computes for that row over the same keys (its slots in position order, q_pos = lens[b] - 1). state_in /
// return_state as for flash_attention.
std::vector<at::Tensor> PREFIXKV_PER_DIM(paged_flash_decode)(at::Tensor q, at::Tensor kv, at::Tensor table,
                                                             at::Tensor lens, int64_t page_size, double scale,
                                                             c10::optional<at::Tensor> state_in, bool return_state,
                                                             int64_t isa) {
  check_inputs(q, kv);
  q = q.contiguous();
  table = table.contiguous();
  lens = lens.contiguous();
  prefixkv::attention::check_pages(table, lens, q.size(0), page_size, "paged_flash_decode");
  const int64_t batch = q.size(0), heads = q.size(1);
  const at::Tensor state0 = checked_state(state_in, batch, heads);
  auto out = at::empty_like(q);
  auto lse = at::empty({batch, heads}, q.options().dtype(at::kFloat));
  auto state = return_state ? at::empty({batch, heads, kStateWidth}, q.options().dtype(at::kFloat)) : at::Tensor();
  prefixkv::attention::PagedDecode args{};
  args.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  args.q_row_stride = heads * kDim;
  args.batch = batch;
  args.heads = heads;
  args.kv = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  args.kv_stride = kv.stride(0);
  args.head_stride = kv.stride(1);
  args.slot_stride = kv.stride(2);
  args.kv_heads = kv.size(1);
  args.table = table.data_ptr<int64_t>();
  args.max_pages = table.size(1);
  args.lens = lens.data_ptr<int64_t>();
  args.page_size = page_size;
  args.scale = static_cast<float>(scale);
  args.state_in = state0.defined() ? state0.data_ptr<float>() : nullptr;
  args.out = out.data_ptr<c10::BFloat16>();
  args.lse = lse.data_ptr<float>();
  args.state = return_state ? state.data_ptr<float>() : nullptr;
  args.head_dim = kDim;
  prefixkv::attention::PREFIXKV_PER_DIM(paged_decode)(args, isa);
  if (return_state) return {out, lse, state};
  return {out, lse};
}

#else

std::vector<at::Tensor> PREFIXKV_PER_DIM(flash_attention)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                                                          c10::optional<at::Tensor>, bool, int64_t) {
  TORCH_CHECK(false, "flash_attention needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
}

std::vector<at::Tensor> PREFIXKV_PER_DIM(paged_flash_decode)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                                                             double, c10::optional<at::Tensor>, bool, int64_t) {
  TORCH_CHECK(false, "paged_flash_decode needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
}

void prefixkv::attention::PREFIXKV_PER_DIM(paged_decode)(const PagedDecode&, int64_t) {
  TORCH_CHECK(false, "paged_flash_decode needs AVX-512 BF16 or AVX2 + FMA (not compiled in)");
}

#define PREFIXKV_ATTENTION_ISA ""

#endif

#if PREFIXKV_HEAD_DIM == 64
// The dispatchers the bindings and the decode loop call: the build for the query's head_dim (64 or 128)
std::vector<at::Tensor> flash_attention_d128(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                                             c10::optional<at::Tensor>, bool, int64_t);
std::vector<at::Tensor> paged_flash_decode_d128(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double,
                                                c10::optional<at::Tensor>, bool, int64_t);

// whether the head_dim is 64 (else 128), failing for any other: the one check of all three dispatchers
static bool is_d64(int64_t head_dim) {
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "native attention covers head_dim 64 and 128, got ", head_dim);
  return head_dim == 64;
}

std::vector<at::Tensor> flash_attention(at::Tensor q, at::Tensor kv, at::Tensor slots, at::Tensor q_pos,
                                        double scale, c10::optional<at::Tensor> state_in, bool return_state,
                                        int64_t isa) {
  TORCH_CHECK(q.dim() == 3, "expected q [R, H, head_dim]");
  auto run = is_d64(q.size(2)) ? &flash_attention_d64 : &flash_attention_d128;
  return run(q, kv, slots, q_pos, scale, state_in, return_state, isa);
}

std::vector<at::Tensor> paged_flash_decode(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                           int64_t page_size, double scale, c10::optional<at::Tensor> state_in,
                                           bool return_state, int64_t isa) {
  TORCH_CHECK(q.dim() == 3, "expected q [B, H, head_dim]");
  auto run = is_d64(q.size(2)) ? &paged_flash_decode_d64 : &paged_flash_decode_d128;
  return run(q, kv, table, lens, page_size, scale, state_in, return_state, isa);
}

void prefixkv::attention::paged_decode(const PagedDecode& args, int64_t isa) {
  (is_d64(args.head_dim) ? &paged_decode_d64 : &paged_decode_d128)(args, isa);
}

bool has_flash_attention() { return PREFIXKV_ATTENTION_ISA[0] != '\0'; }

// the instruction set of the vector path (isa 0): "avx512_bf16", "avx2", or "" (not compiled in)
std::string attention_isa() { return PREFIXKV_ATTENTION_ISA; }
#endif
