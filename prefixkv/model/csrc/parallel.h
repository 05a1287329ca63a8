// Work items shared out to the intra-op threads one at a time, as each thread finishes its last.
//
// Why not at::parallel_for: it gives each thread a fixed share up front, so a region lasts as long as its slowest
// thread, and on a machine whose cores are shared (a server's event loop, a client on the same two cores) the OS
// preempts one thread for milliseconds now and then: a load of 12% of the machine slowed decode steps by half
// (measured on SmolLM2, 2 threads). Here a preempted thread delays only the item it holds; the others take the
// rest. Which thread computes an item never changes what it computes.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace prefixkv {

// body(state, i) for every item i in [0, n); each thread first makes its own state = make_state() (scratch
// buffers, an AMX tile configuration) and keeps it for all the items it takes
template <class MakeState, class Body>
void parallel_items(int64_t n, const MakeState& make_state, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || omp_in_parallel()) {
    auto state = make_state();
    for (int64_t i = 0; i < n; ++i) body(state, i);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    auto state = make_state();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(state, i);
  }
}

// the same without per-thread state: body(i)
template <class Body>
void parallel_items(int64_t n, const Body& body) {
  parallel_items(n, [] { return 0; }, [&](int, int64_t i) { body(i); });
}

}  // namespace prefixkv
