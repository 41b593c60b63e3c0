// Which path runs: what the CPU supports (cpuid on x86 through the compiler's __builtin_cpu_supports,
// which also checks that the OS saves the wide registers; getauxval on Linux/ARM), intersected with what
// was compiled in. The chosen path can be changed at run time (set_active: DRAFTWISE_ISA, applied from
// Python, or tests running every path the CPU has, a lower path on a bigger CPU).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/qmm.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace dw {

namespace {

struct Path {
  const char* name;
  const IsaOps* (*ops)();
  bool (*cpu_has)();
};

const IsaOps* scalar_ops() { return &kScalar; }
bool always() { return true; }

#if defined(__x86_64__) || defined(_M_X64)
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }
bool has_avxvnni() {
#if defined(__clang__) || __GNUC__ >= 11
  return has_avx2() && __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
bool has_avx512vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }
bool never() { return false; }
const Path kPaths[] = {{"scalar", scalar_ops, always},       {"avx2", avx2_ops, has_avx2},
                       {"avxvnni", avxvnni_ops, has_avxvnni}, {"avx512", avx512_ops, has_avx512},
                       {"avx512vnni", avx512vnni_ops, has_avx512vnni}, {"neon", neon_ops, never},
                       {"neondot", neondot_ops, never}};
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
bool never() { return false; }
const Path kPaths[] = {{"scalar", scalar_ops, always}, {"neon", neon_ops, always}, {"neondot", neondot_ops, has_dot},
                       {"avx2", avx2_ops, never},      {"avxvnni", avxvnni_ops, never},
                       {"avx512", avx512_ops, never},  {"avx512vnni", avx512vnni_ops, never}};
#else
bool never() { return false; }
const Path kPaths[] = {{"scalar", scalar_ops, always}, {"neon", neon_ops, never}, {"neondot", neondot_ops, never},
                       {"avx2", avx2_ops, never}, {"avxvnni", avxvnni_ops, never}, {"avx512", avx512_ops, never},
                       {"avx512vnni", avx512vnni_ops, never}};
#endif
constexpr int kNumPaths = sizeof(kPaths) / sizeof(kPaths[0]);

bool usable(const Path& p) { return p.cpu_has() && p.ops() != nullptr; }

const IsaOps* best() {
  // preference order, best first
  static const char* order[] = {"avx512vnni", "avx512", "avxvnni", "avx2", "neondot", "neon", "scalar"};
  for (const char* name : order)
    for (const Path& p : kPaths)
      if (!std::strcmp(p.name, name) && usable(p)) return p.ops();
  return &kScalar;
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
    __builtin_cpu_init();
    for (const char* n : names) {
      bool has = false;
      if (!std::strcmp(n, "sse4.2")) has = __builtin_cpu_supports("sse4.2");
      else if (!std::strcmp(n, "avx")) has = __builtin_cpu_supports("avx");
      else if (!std::strcmp(n, "avx2")) has = __builtin_cpu_supports("avx2");
      else if (!std::strcmp(n, "fma")) has = __builtin_cpu_supports("fma");
      else if (!std::strcmp(n, "f16c")) has = __builtin_cpu_supports("f16c");
      else if (!std::strcmp(n, "avxvnni")) has = has_avxvnni();
      else if (!std::strcmp(n, "avx512f")) has = __builtin_cpu_supports("avx512f");
      else if (!std::strcmp(n, "avx512bw")) has = __builtin_cpu_supports("avx512bw");
      else if (!std::strcmp(n, "avx512dq")) has = __builtin_cpu_supports("avx512dq");
      else if (!std::strcmp(n, "avx512vl")) has = __builtin_cpu_supports("avx512vl");
      else if (!std::strcmp(n, "avx512vnni")) has = __builtin_cpu_supports("avx512vnni");
#if defined(__clang__) || __GNUC__ >= 12
      else if (!std::strcmp(n, "avx512bf16")) has = __builtin_cpu_supports("avx512bf16");
      else if (!std::strcmp(n, "amx-int8")) has = __builtin_cpu_supports("amx-int8");
      else if (!std::strcmp(n, "amx-bf16")) has = __builtin_cpu_supports("amx-bf16");
#endif
      if (has) r += std::string(r.empty() ? "" : " ") + n;
    }
#elif defined(__aarch64__)
    r = "neon";
    for (const Path& p : kPaths)
      if (!std::strcmp(p.name, "neondot") && p.cpu_has()) r += " dotprod";
#else
    r = "(no SIMD paths for this architecture)";
#endif
    return r;
  }();
  return s.c_str();
}

int available_paths(const char** names, int cap) {
  int n = 0;
  for (const Path& p : kPaths)
    if (usable(p) && n < cap) names[n++] = p.name;
  return n;
}

const IsaOps* path_by_name(const char* name) {
  if (!name) return nullptr;
  if (!std::strcmp(name, "auto")) return best();
  if (!std::strcmp(name, "vnni")) {  // the widest VNNI path this CPU has
    for (const char* n : {"avx512vnni", "avxvnni"})
      if (const IsaOps* o = path_by_name(n)) return o;
    return nullptr;
  }
  for (const Path& p : kPaths)
    if (!std::strcmp(p.name, name)) return usable(p) ? p.ops() : nullptr;
  return nullptr;
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
