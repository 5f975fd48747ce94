// dynamic_for: a loop's chunks split between torch's threads as a fixed split would, except that a
// thread that finishes its share takes the chunks the others have not started. Where the threads
// run at different speeds (they share the memory bus and the host's scheduler; a VM's cores are
// not always there), a fixed split leaves the faster thread waiting at the region's end: in W1 on
// a 2-core Xeon with AMX, libgomp's barrier waited through ~8% of the samples, beside the GEMMs
// and decode attention. The chunks' results do not depend on which thread ran them.
//
// In an anonymous namespace, as attention_common.h: each kernel's translation unit gets its own.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace {

// body(c) for every c in [0, chunks), each on one of torch's threads; enter() before a thread's
// first chunk and leave() after its last (per-thread state: AMX's tile configuration). In order on
// this thread where one thread runs, or inside a parallel region.
//
// Each thread owns a contiguous share of the chunks, as a fixed split would give it, and runs it in
// order (a GEMM's weight panels stay one stream a thread: handing out chunks one by one from a
// shared counter interleaved the threads' panels and made 64-row products 10-15% slower); a thread
// that finishes its share takes the next unclaimed chunks of the others' shares, from their fronts.
template <typename Enter, typename Body, typename Leave>
void dynamic_for(int64_t chunks, const Enter& enter, const Body& body, const Leave& leave) {
  if (chunks <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    enter();
    for (int64_t c = 0; c < chunks; ++c) body(c);
    leave();
    return;
  }
  struct alignas(64) Share {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::vector<Share> shares(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].next.store(chunks * t / threads, std::memory_order_relaxed);
    shares[t].end = chunks * (t + 1) / threads;
  }
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    enter();
    for (int64_t own = lo; own < hi; ++own) {
      for (int64_t k = 0; k < threads; ++k) {  // its own share first, then the others' in turn
        Share& s = shares[(own + k) % threads];
        for (int64_t c = s.next.fetch_add(1, std::memory_order_relaxed); c < s.end;
             c = s.next.fetch_add(1, std::memory_order_relaxed))
          body(c);
      }
    }
    leave();
  });
}

}  // namespace
