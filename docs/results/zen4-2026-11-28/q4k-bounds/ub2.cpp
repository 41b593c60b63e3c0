#include <immintrin.h>
#include <chrono>
#include <cstdio>
alignas(64) int xs[4096];
#define D(a) "vpdpbusd %%zmm20, %%zmm21, %%" #a "\n"
#define DB(a, off) "vpbroadcastd " #off "(%[x]), %%zmm22\n vpdpbusd %%zmm22, %%zmm21, %%" #a "\n"
#define L(a) "vpandd %%zmm23, %%zmm24, %%" #a "\n"
template <int M> __attribute__((noinline)) void run(long n) {
  for (long i = 0; i < n; ++i) {
    if constexpr (M == 0) asm volatile(D(zmm0) D(zmm1) D(zmm2) D(zmm3) D(zmm4) D(zmm5) D(zmm6) D(zmm7) :: [x]"r"(xs) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm22","xmm25","xmm26","xmm27");
    if constexpr (M == 1) asm volatile(DB(zmm0,0) DB(zmm1,4) DB(zmm2,8) DB(zmm3,12) DB(zmm4,16) DB(zmm5,20) DB(zmm6,24) DB(zmm7,28) :: [x]"r"(xs) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm22","xmm25","xmm26","xmm27");
    if constexpr (M == 2) asm volatile(DB(zmm0,0) DB(zmm1,4) DB(zmm2,8) DB(zmm3,12) DB(zmm4,16) DB(zmm5,20) DB(zmm6,24) DB(zmm7,28) L(zmm25) L(zmm26) L(zmm27) :: [x]"r"(xs) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm22","xmm25","xmm26","xmm27");
    if constexpr (M == 3) asm volatile(D(zmm0) D(zmm1) D(zmm2) D(zmm3) D(zmm4) D(zmm5) D(zmm6) D(zmm7) L(zmm25) L(zmm26) L(zmm27) :: [x]"r"(xs) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm22","xmm25","xmm26","xmm27");
    if constexpr (M == 4) asm volatile(
      "vpbroadcastd 0(%[x]), %%zmm22\n vpbroadcastd 4(%[x]), %%zmm25\n vpbroadcastd 8(%[x]), %%zmm26\n vpbroadcastd 12(%[x]), %%zmm27\n"
      "vpbroadcastd 16(%[x]), %%zmm22\n vpbroadcastd 20(%[x]), %%zmm25\n vpbroadcastd 24(%[x]), %%zmm26\n vpbroadcastd 28(%[x]), %%zmm27\n"
      :: [x]"r"(xs) : "xmm22","xmm25","xmm26","xmm27");
    if constexpr (M == 5) asm volatile(L(zmm0) L(zmm1) L(zmm2) L(zmm3) L(zmm4) L(zmm5) L(zmm6) L(zmm7) :: [x]"r"(xs) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
    if constexpr (M == 6) asm volatile(DB(zmm0,0) DB(zmm1,4) DB(zmm2,8) DB(zmm3,12) DB(zmm4,16) DB(zmm5,20) DB(zmm6,24) DB(zmm7,28) L(zmm25) L(zmm26) L(zmm27) "vpmulld %%zmm23, %%zmm28, %%zmm28\n vpsllvd %%zmm23, %%zmm29, %%zmm29\n vpaddd %%zmm23, %%zmm30, %%zmm30\n" :: [x]"r"(xs) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm22","xmm25","xmm26","xmm27","xmm28","xmm29","xmm30");
  }
}
template <int M> void t(const char* name) {
  const long n = 20000000; double best = 1e9;
  for (int r = 0; r < 5; ++r) { auto t0 = std::chrono::steady_clock::now(); run<M>(n); double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (s < best) best = s; }
  printf("%-40s %.3f ns / iteration (%.2f dpbusd-cycles at 0.2725 ns)\n", name, best / n * 1e9, best / n * 1e9 / 0.2725);
}
int main() { t<0>("8 dpbusd"); t<1>("8 (bcast mem + dpbusd)"); t<2>("8 (bcast+dpbusd) + 3 logic"); t<3>("8 dpbusd + 3 logic"); t<4>("8 bcast mem only"); t<5>("8 logic only (indep)"); t<6>("8 (bcast+dpbusd)+3 logic+mul+sllv+add"); }
