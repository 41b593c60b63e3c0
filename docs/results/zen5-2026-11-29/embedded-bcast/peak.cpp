// vpdpbusd zmm throughput: C independent chains held in named registers (an array of accumulators, as in
// ../../zen5-2026-11-27/s25/kernel-rates/peak.c, was kept on the stack: each dot product then waited on a
// store and a load, and that program read half the peak). g++ -O2 -march=native peak.cpp -o peak && (./peak & ./peak; wait)
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define D(i) a##i = _mm512_dpbusd_epi32(a##i, w, w);
template <int C>
__attribute__((noinline)) __m512i run(__m512i w, long n) {
  __m512i a0 = _mm512_set1_epi32(n), a1 = _mm512_set1_epi32(n + 1), a2 = _mm512_set1_epi32(n + 2),
          a3 = _mm512_set1_epi32(n + 3), a4 = _mm512_set1_epi32(n + 4), a5 = _mm512_set1_epi32(n + 5),
          a6 = _mm512_set1_epi32(n + 6), a7 = _mm512_set1_epi32(n + 7), a8 = _mm512_set1_epi32(n + 8),
          a9 = _mm512_set1_epi32(n + 9), a10 = _mm512_set1_epi32(n + 10), a11 = _mm512_set1_epi32(n + 11),
          a12 = _mm512_set1_epi32(n + 12), a13 = _mm512_set1_epi32(n + 13), a14 = _mm512_set1_epi32(n + 14),
          a15 = _mm512_set1_epi32(n + 15);
  for (long it = 0; it < n; ++it) {
    D(0) D(1) D(2) D(3)
    if (C > 4) { D(4) D(5) D(6) D(7) }
    if (C > 8) { D(8) D(9) D(10) D(11) }
    if (C > 12) { D(12) D(13) D(14) D(15) }
    asm volatile("" : "+v"(w));
  }
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                               _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)),
                                           _mm512_add_epi32(_mm512_add_epi32(a12, a13), _mm512_add_epi32(a14, a15))));
  return s;
}
template <int C> void t() {
  const long n = 400000000 / C;
  const auto t0 = std::chrono::steady_clock::now();
  const __m512i s = run<C>(_mm512_set1_epi8(3), n);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int r[16];
  _mm512_storeu_si512(r, s);
  std::printf("%2d chains: %.2f G vpdpbusd/s, %.0f GMAC/s (chk %d)\n", C, n * C / dt / 1e9, n * C * 64 / dt / 1e9, r[0] & 1);
}
int main() { t<4>(); t<8>(); t<12>(); t<16>(); }
