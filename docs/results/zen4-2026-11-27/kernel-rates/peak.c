#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target("avx512f,avx512vnni,avx512bw")))
double run512(long n){
  __m512i a[24]; __m512i w=_mm512_set1_epi8(3), x=_mm512_set1_epi8(5);
  for(int i=0;i<24;i++)a[i]=_mm512_setzero_si512();
  double t0=now();
  for(long k=0;k<n;k++){
    for(int i=0;i<24;i++) a[i]=_mm512_dpbusd_epi32(a[i],w,x);
    __asm__ volatile("" : "+v"(w));
  }
  double t=now()-t0; int s=0; for(int i=0;i<24;i++) s+=_mm512_reduce_add_epi32(a[i]);
  printf("512: %.1f GMAC/s per core (chk %d)\n", n*24*64.0/t/1e9, s&1); return t;}
__attribute__((target("avx512f,avx512vl,avx512vnni")))
double run256(long n){
  __m256i a[24]; __m256i w=_mm256_set1_epi8(3), x=_mm256_set1_epi8(5);
  for(int i=0;i<24;i++)a[i]=_mm256_setzero_si256();
  double t0=now();
  for(long k=0;k<n;k++){
    for(int i=0;i<24;i++) a[i]=_mm256_dpbusd_epi32(a[i],w,x);
    __asm__ volatile("" : "+v"(w));
  }
  double t=now()-t0; int s=0; for(int i=0;i<24;i++) s+=_mm256_extract_epi32(a[i],0);
  printf("256: %.1f GMAC/s per core (chk %d)\n", n*24*32.0/t/1e9, s&1); return t;}
int main(){run512(100000000);run256(100000000);run512(100000000);}
