// Peak 512-bit float adds, FMAs, and adds and multiplies together, on one core: 12 independent accumulators
// held in registers. gcc -O2 -mavx512f peakfp.c && ./a.out
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define R6A(M) M(0) M(1) M(2) M(3) M(4) M(5)
#define R6B(M) M(6) M(7) M(8) M(9) M(10) M(11)
#define DECL(i) __m512 a##i = _mm512_set1_ps(i);
#define ADD(i) a##i = _mm512_add_ps(a##i, x);
#define MUL(i) a##i = _mm512_mul_ps(a##i, y);
#define FMA(i) a##i = _mm512_fmadd_ps(x, y, a##i);
#define KEEP(i) __asm__ volatile("" : "+v"(a##i));
#define SUM(i) s += _mm512_reduce_add_ps(a##i);

int main(void) {
  const long N = 200000000;
  __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  R12(DECL)
  float s = 0;
  double t = now();
  for (long n = 0; n < N; n++) { R12(ADD) R12(KEEP) }
  t = now() - t;
  printf("adds: %.2f G/s\n", N * 12.0 / t / 1e9);
  t = now();
  for (long n = 0; n < N; n++) { R12(FMA) R12(KEEP) }
  t = now() - t;
  printf("FMAs: %.2f G/s\n", N * 12.0 / t / 1e9);
  t = now();
  for (long n = 0; n < N; n++) { R6A(ADD) R6B(MUL) R12(KEEP) }
  t = now() - t;
  R12(SUM)
  printf("adds + multiplies: %.2f G/s (%g)\n", N * 12.0 / t / 1e9, s);
  return 0;
}
