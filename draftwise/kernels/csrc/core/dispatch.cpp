// Which path runs: the paths of core/paths.def, what the CPU supports (cpuid on x86, arch/x86/cpu_features.h,
// which also checks that the OS saves the wide registers; getauxval on Linux/ARM), intersected with what
// was compiled in. The chosen path can be changed at run time (set_active: DRAFTWISE_ISA, applied from
// Python, or tests running every path the CPU has, a lower path on a bigger CPU).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "arch/x86/amx.h"  // amx_usable
#include "arch/x86/cpu_features.h"  // cpu_has
#include "core/kquant.h"  // kq_format_bit
#include "core/qmm.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace dw {

namespace {

// ---- CPU checks (the cpu_check column of paths.def) ----
bool always() { return true; }
bool never() { return false; }
#if defined(__x86_64__) || defined(_M_X64)
bool has_avx2() { return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c"); }
bool has_avxvnni() { return has_avx2() && cpu_has("avxvnni"); }
bool has_avx512() {
  return has_avx2() && cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512dq") && cpu_has("avx512vl");
}
bool has_avx512vnni() { return has_avx512() && cpu_has("avx512vnni"); }
// cpuid, XCR0, Linux's permission for the tile data, and the forked bit-for-bit check (arch/x86/amx.h)
bool has_amx() { return has_avx512vnni() && amx_usable(); }
#elif defined(__aarch64__)
bool has_dot() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
  return true;  // every Apple M-series core has the dot-product extension
#else
  return false;
#endif
}
#endif

// A path of another architecture's family never runs here (and its CPU check is not compiled).
#define DW_CHECK_ANY(check) check
#if defined(__x86_64__) || defined(_M_X64)
#define DW_CHECK_X86(check) check
#define DW_CHECK_ARM(check) never
#elif defined(__aarch64__)
#define DW_CHECK_X86(check) never
#define DW_CHECK_ARM(check) check
#else
#define DW_CHECK_X86(check) never
#define DW_CHECK_ARM(check) never
#endif

enum class Family { ANY, X86, ARM };

struct Path {
  const char* name;
  Family family;
  const IsaOps* (*ops)();
  bool (*cpu_has)();
  int rank;
};

// the path table: paths.def, one row per line
constexpr Path kPaths[] = {
#define DW_PATH(name, family, cpu_check, rank) {#name, Family::family, name##_ops, DW_CHECK_##family(cpu_check), rank},
#include "core/paths.def"
#undef DW_PATH
};
constexpr int kNumPaths = sizeof(kPaths) / sizeof(kPaths[0]);
#undef DW_CHECK_ANY
#undef DW_CHECK_X86
#undef DW_CHECK_ARM

constexpr bool same_name(const char* a, const char* b) {
  while (*a && *a == *b) ++a, ++b;
  return *a == *b;
}
// two paths that can run on one CPU (one family, or one of them ANY) need distinct ranks, every path a distinct name
constexpr bool table_ok() {
  for (int i = 0; i < kNumPaths; ++i)
    for (int j = i + 1; j < kNumPaths; ++j) {
      if (same_name(kPaths[i].name, kPaths[j].name)) return false;
      const bool together = kPaths[i].family == kPaths[j].family || kPaths[i].family == Family::ANY ||
                            kPaths[j].family == Family::ANY;
      if (together && kPaths[i].rank == kPaths[j].rank) return false;
    }
  return true;
}
static_assert(table_ok(), "core/paths.def: duplicate path name, or two paths of one family with the same rank");

constexpr const char* family_name(Family f) { return f == Family::X86 ? "X86" : f == Family::ARM ? "ARM" : "ANY"; }

bool usable(const Path& p) { return p.cpu_has() && p.ops() != nullptr; }

// the usable path of the highest rank among those whose name contains `part` (all when empty)
const Path* best_of(const char* part) {
  const Path* b = nullptr;
  for (const Path& p : kPaths)
    if (std::strstr(p.name, part) && usable(p) && (!b || p.rank > b->rank)) b = &p;
  return b;
}

const IsaOps* best() {
  const Path* b = best_of("");
  return b ? b->ops() : &kScalar;
}

std::atomic<const IsaOps*> g_active{nullptr};
std::atomic<const IsaOps*> g_multi{nullptr};  // calls of kMultiRows rows or more, when set

}  // namespace

const char* cpu_features() {
  static std::string s = [] {
    std::string r;
#if defined(__x86_64__) || defined(_M_X64)
    const char* names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avxvnni", "avx512f", "avx512bw", "avx512dq",
                           "avx512vl", "avx512vnni", "avx512bf16", "amx-int8", "amx-bf16"};
    for (const char* n : names) {
      const bool has = cpu_has(n);
      if (has) r += std::string(r.empty() ? "" : " ") + n;
    }
#elif defined(__aarch64__)
    r = has_dot() ? "neon dotprod" : "neon";
#else
    r = "(no SIMD paths for this architecture)";
#endif
    return r;
  }();
  return s.c_str();
}

int path_count() { return kNumPaths; }

PathInfo path_info(int i) {
  if (i < 0 || i >= kNumPaths) return {nullptr, nullptr, 0};
  return {kPaths[i].name, family_name(kPaths[i].family), kPaths[i].rank};
}

int available_paths(const char** names, int cap) {
  const Path* found[kNumPaths];
  int n = 0;
  for (const Path& p : kPaths)
    if (usable(p)) {  // insert by rank, lowest first
      int i = n++;
      for (; i > 0 && found[i - 1]->rank > p.rank; --i) found[i] = found[i - 1];
      found[i] = &p;
    }
  for (int i = 0; i < n && i < cap; ++i) names[i] = found[i]->name;
  return n < cap ? n : cap;
}

const IsaOps* path_by_name(const char* name) {
  if (!name) return nullptr;
  if (!std::strcmp(name, "auto")) return best();
  if (!std::strcmp(name, "vnni")) {  // the best VNNI path this CPU has (avx512vnni, avxvnni)
    const Path* b = best_of("vnni");
    return b ? b->ops() : nullptr;
  }
  for (const Path& p : kPaths)
    if (!std::strcmp(p.name, name)) return usable(p) ? p.ops() : nullptr;
  return nullptr;
}

namespace {
std::atomic<uint32_t> g_kq_pf_l2{0};  // bit kq_format_bit(fmt): that format's codes are prefetched into L2
std::atomic<uint32_t> g_kq6_many{kKq6AllMany};  // bit kq6_shape(M, K): those Q6_K calls take kq6_tile_many
}  // namespace

uint32_t kq6_many_mask() { return g_kq6_many.load(std::memory_order_relaxed); }

void kq6_set_many_mask(uint32_t mask) { g_kq6_many.store(mask & kKq6AllMany, std::memory_order_relaxed); }

bool kq6_many() { return kq6_many_mask() == kKq6AllMany; }

void kq6_set_many(bool many) { kq6_set_many_mask(many ? kKq6AllMany : 0); }

bool kq_prefetch_l2(int fmt) { return (g_kq_pf_l2.load(std::memory_order_relaxed) >> kq_format_bit(fmt)) & 1u; }

void kq_set_prefetch_l2(int fmt, bool l2) {
  const uint32_t bit = 1u << kq_format_bit(fmt);
  if (l2) g_kq_pf_l2.fetch_or(bit);
  else g_kq_pf_l2.fetch_and(~bit);
}

const IsaOps* active() {
  const IsaOps* a = g_active.load(std::memory_order_acquire);
  if (a) return a;
  const IsaOps* chosen = best();  // DRAFTWISE_ISA is applied by the Python side (kernels.extension: set_isa)
  g_active.store(chosen, std::memory_order_release);
  return chosen;
}

bool set_active(const char* name) {
  const IsaOps* o = path_by_name(name);
  if (!o) return false;
  g_active.store(o, std::memory_order_release);
  g_multi.store(nullptr, std::memory_order_release);
  return true;
}

const IsaOps* active_for(int64_t rows) {
  if (rows >= kMultiRows)
    if (const IsaOps* m = g_multi.load(std::memory_order_acquire)) return m;
  return active();
}

bool set_multi(const char* name) {
  if (!name || !*name) {
    g_multi.store(nullptr, std::memory_order_release);
    return true;
  }
  const IsaOps* o = path_by_name(name);
  if (!o) return false;
  g_multi.store(o, std::memory_order_release);
  return true;
}

const char* multi_name() {
  const IsaOps* m = g_multi.load(std::memory_order_acquire);
  return m ? m->name : "";
}

}  // namespace dw
