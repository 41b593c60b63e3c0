// The kernel's thread pool (pool.h): chunks claimed from one atomic counter; no barrier.
#include "core/pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { __asm__ __volatile__("yield"); }
#else
static inline void cpu_relax() {}
#endif

namespace dw {
namespace {

constexpr int kMaxHelpers = 255;
// how long an idle helper spins for the next call before it sleeps: the calls of one decode step come
// a few microseconds apart; between steps (sampling, Python) a helper sleeps and costs one wake-up
constexpr auto kSpinFor = std::chrono::microseconds(200);

struct Job {
  ChunkFn fn;
  void* ctx;
};

// One pool per process (a new one in a forked child, whose helper threads do not exist).
struct Pool {
  // claim word: item count n (high 32 bits) and the next item to hand out (low 32 bits). Chunks are
  // claimed by compare-and-swap, their size a share of what remains (big first, small last, so that
  // the threads finish together: guided scheduling). A successful claim is a range of the job now
  // posted, which cannot finish (nor the next job be posted) before that range is done: so the claimer
  // may read `job` until it counts its items done.
  std::atomic<uint64_t> claim{0};
  std::atomic<int64_t> done{0};     // items done
  std::atomic<uint32_t> posted{0};  // incremented per job: what waiting helpers watch
  std::atomic<int> active{0};       // helpers taking part (threads - 1 of the latest call)
  std::atomic<int> sleepers{0};
  Job job{};
  std::atomic<int64_t> grain{1}, parts{1};  // chunk size: what remains / parts, at least grain
  int helpers = 0;       // started so far (under call_mu)
  std::mutex call_mu;    // one call at a time; a concurrent call runs on its own thread
  std::mutex sleep_mu;
  std::condition_variable wake;
};

std::atomic<Pool*> g_pool{nullptr};
std::once_flag g_atfork_once;

void forget_pool_in_child() { g_pool.store(nullptr); }  // the old one is leaked: its helpers are gone

// claim and run chunks of the posted job until none is left
void run_chunks(Pool* p) {
  uint64_t c = p->claim.load(std::memory_order_acquire);
  for (;;) {
    const int64_t next = (int64_t)(c & 0xffffffffu), n = (int64_t)(c >> 32);
    if (next >= n) return;
    // grain and parts may already be the next job's (a helper late to a finished job): they only size
    // this attempt; the swap succeeds only on the word read here, so the range is always one of the
    // job posted with that word
    const int64_t parts = p->parts.load(std::memory_order_relaxed), grain = p->grain.load(std::memory_order_relaxed);
    int64_t size = (n - next) / (parts > 0 ? parts : 1);
    if (size < grain) size = grain;
    if (size < 1) size = 1;
    const int64_t end = next + size < n ? next + size : n;
    if (!p->claim.compare_exchange_weak(c, (c & ~(uint64_t)0xffffffffu) | (uint64_t)end, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
      continue;  // c now holds the current word
    const Job mine = p->job;  // the claimed job's (synchronized by the swap)
    mine.fn(mine.ctx, next, end);
    p->done.fetch_add(end - next, std::memory_order_release);
    c = p->claim.load(std::memory_order_acquire);
  }
}

void helper_main(Pool* p, int id) {
  uint32_t seen = p->posted.load(std::memory_order_seq_cst);
  bool spin = false;  // only a helper that took part in the last job spins for the next one
  for (;;) {
    uint32_t now = p->posted.load(std::memory_order_seq_cst);
    if (now == seen) {
      const auto until = std::chrono::steady_clock::now() + (spin ? kSpinFor : std::chrono::microseconds(0));
      for (int i = 0; now == seen; ++i) {
        cpu_relax();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lk(p->sleep_mu);
          p->sleepers.fetch_add(1, std::memory_order_seq_cst);
          p->wake.wait(lk, [&] { return p->posted.load(std::memory_order_seq_cst) != seen; });
          p->sleepers.fetch_sub(1, std::memory_order_seq_cst);
        }
        now = p->posted.load(std::memory_order_seq_cst);
      }
    }
    seen = now;
    spin = id < p->active.load(std::memory_order_relaxed);  // helpers beyond the thread count sleep
    if (spin) run_chunks(p);
  }
}

Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return p;
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  static std::mutex create_mu;  // a function-local static: constructed on first use, never destroyed early
  std::lock_guard<std::mutex> lk(create_mu);
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
    p = new Pool();  // never deleted: helpers may still be waiting on it when the process exits
    g_pool.store(p, std::memory_order_release);
  }
  return p;
}

}  // namespace

void parallel_chunks(int64_t n, int64_t grain, int threads, ChunkFn fn, void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (threads > kMaxHelpers + 1) threads = kMaxHelpers + 1;
  if (threads <= 1 || n <= grain || n >= (int64_t(1) << 31)) {
    fn(ctx, 0, n);
    return;
  }
  Pool* p = pool();
  std::unique_lock<std::mutex> call(p->call_mu, std::try_to_lock);
  if (!call.owns_lock()) {  // another thread's call holds the helpers: do this one here
    fn(ctx, 0, n);
    return;
  }
  while (p->helpers < threads - 1) {
    try {
      std::thread(helper_main, p, p->helpers).detach();
      ++p->helpers;
    } catch (const std::system_error&) {  // no more threads: run with those there are
      break;
    }
  }
  const int use = threads - 1 < p->helpers ? threads - 1 : p->helpers;
  if (use == 0) {
    fn(ctx, 0, n);
    return;
  }
  p->active.store(use, std::memory_order_relaxed);
  p->job = Job{fn, ctx};
  p->grain.store(grain, std::memory_order_relaxed);
  p->parts.store((int64_t)(use + 1) * kGuidedParts, std::memory_order_relaxed);
  p->done.store(0, std::memory_order_relaxed);
  p->claim.store((uint64_t)n << 32, std::memory_order_release);
  p->posted.fetch_add(1, std::memory_order_seq_cst);
  if (p->sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lk(p->sleep_mu);
    p->wake.notify_all();
  }
  run_chunks(p);
  // only chunks a helper has started remain: wait for those
  for (int i = 0; p->done.load(std::memory_order_acquire) < n; ++i) {
    if (i < 4096) cpu_relax();
    else std::this_thread::yield();
  }
}

}  // namespace dw
