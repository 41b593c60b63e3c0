// The kernel's threads: a small pool whose calls are not stalled by a busy core.
//
// OpenMP (torch's at::parallel_for) gives each thread one piece of a call, meets at a barrier, and keeps
// its threads spinning between calls. When another process holds one of the cores, the thread that
// shares it with that process runs late (up to a scheduler time slice, milliseconds) and every call of a
// decode step (~140 per token for a 28-layer model) waits for it. Here a call is cut into chunks taken
// one at a time from a shared counter by the caller and by helper threads; the caller
// waits only for chunks a helper has already started, so a helper that is not running when the call
// comes finds no chunk left and is never waited for. Helpers spin only briefly, then sleep.
// Measured (Qwen 1.5B `ar`, AMD EPYC Zen 3, 2 cores, 2 threads, `yes > /dev/null` beside it): 4.4-4.7
// tok/s through OpenMP, 8.9-9.3 through this pool (one thread alone: 10-12); idle, the same speed
// (OpenMP with OMP_WAIT_POLICY=PASSIVE instead: 9.4-9.7 busy, but 22 % slower idle).
//
// Which thread computes a chunk never changes a result: each item is written by exactly one chunk, and
// the kernels compute an item the same way whatever range it is in (batch invariance, qmm.h).
// No torch here: the kernel core (and its selftest) stays independent of torch.
#pragma once
#include <cstdint>

namespace dw {

using ChunkFn = void (*)(void* ctx, int64_t i0, int64_t i1);

// fn(ctx, i0, i1) over [0, n) in chunks of at least `grain` items on up to `threads` threads (the caller
// and threads - 1 helpers). Returns when every item is done. Calls from two threads at once are safe: the
// second runs its items on its own thread. fn must not throw (a helper has no caller to throw to).
void parallel_chunks(int64_t n, int64_t grain, int threads, ChunkFn fn, void* ctx);

// the same for a callable f(i0, i1)
template <class F>
inline void parallel_for(int64_t n, int64_t grain, int threads, const F& f) {
  parallel_chunks(n, grain, threads, [](void* c, int64_t i0, int64_t i1) { (*(const F*)c)(i0, i1); }, (void*)&f);
}

// chunk sizes (guided): each claim takes what remains / (kGuidedParts * threads), at least the grain, so
// chunks start long (each thread streams long runs of weight rows) and end short (the threads finish
// together, and a helper that stalls mid-chunk holds back little)
constexpr int64_t kGuidedParts = 2;

}  // namespace dw
