// x86-64 CPU features from cpuid and XCR0, the same answers on every compiler: GCC's and clang's
// __builtin_cpu_supports know different sets of names (clang 14 rejects "f16c", "avxvnni" and the AMX ones at
// compile time), so the kernel asks the CPU itself. A feature that needs wide registers counts only where the
// OS saves them (XCR0, as __builtin_cpu_supports checks): ymm for the AVX family, zmm and the mask registers
// for AVX-512, the tile state for AMX.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <cstdint>
#include <cstring>

namespace dw {

// name -> (cpuid leaf, subleaf, register 0-3 = eax ebx ecx edx, bit, XCR0 bits the OS must save)
struct CpuFeature {
  const char* name;
  unsigned leaf, subleaf, reg, bit;
  uint64_t xcr0;
};

constexpr uint64_t kXcr0Ymm = 0x6;           // SSE and AVX state
constexpr uint64_t kXcr0Zmm = 0xE6;          // ... and opmask, the upper halves of zmm0-15, zmm16-31
constexpr uint64_t kXcr0Tile = 0x60000 | 0xE6;  // ... and XTILECFG, XTILEDATA

constexpr CpuFeature kCpuFeatures[] = {
    {"sse4.2", 1, 0, 2, 20, 0},           {"avx", 1, 0, 2, 28, kXcr0Ymm},
    {"fma", 1, 0, 2, 12, kXcr0Ymm},       {"f16c", 1, 0, 2, 29, kXcr0Ymm},
    {"avx2", 7, 0, 1, 5, kXcr0Ymm},       {"avxvnni", 7, 1, 0, 4, kXcr0Ymm},
    {"avx512f", 7, 0, 1, 16, kXcr0Zmm},   {"avx512dq", 7, 0, 1, 17, kXcr0Zmm},
    {"avx512bw", 7, 0, 1, 30, kXcr0Zmm},  {"avx512vl", 7, 0, 1, 31, kXcr0Zmm},
    {"avx512vnni", 7, 0, 2, 11, kXcr0Zmm}, {"avx512bf16", 7, 1, 0, 5, kXcr0Zmm},
    {"amx-bf16", 7, 0, 3, 22, kXcr0Tile}, {"amx-tile", 7, 0, 3, 24, kXcr0Tile},
    {"amx-int8", 7, 0, 3, 25, kXcr0Tile},
};

// the state components the OS saves (0 where xgetbv is absent: CPUID.1:ECX.OSXSAVE clear)
inline uint64_t cpu_xcr0() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;
  uint32_t lo = 0, hi = 0;
  __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// whether the CPU has feature `name` (one of kCpuFeatures) and the OS saves the registers it needs; an
// unknown name is false
inline bool cpu_has(const char* name) {
  for (const CpuFeature& f : kCpuFeatures) {
    if (std::strcmp(f.name, name) != 0) continue;
    unsigned r[4] = {0, 0, 0, 0};
    if (!__get_cpuid_count(f.leaf, f.subleaf, &r[0], &r[1], &r[2], &r[3])) return false;
    if (!(r[f.reg] & (1u << f.bit))) return false;
    return f.xcr0 == 0 || (cpu_xcr0() & f.xcr0) == f.xcr0;
  }
  return false;
}

}  // namespace dw
#endif
