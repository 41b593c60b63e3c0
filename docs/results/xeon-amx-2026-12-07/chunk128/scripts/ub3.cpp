// Build: g++ -O2 -mamx-tile -mamx-int8 -mavx512f ub3.cpp -o ub3; ./ub3 M K MODE EPI
// groups of 16 rows over a row of super-blocks, A (M x K) strided; modes
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <unistd.h>
#include <sys/syscall.h>
struct alignas(64) Cfg { uint8_t palette=1, start=0; uint8_t res[14]={}; uint16_t colsb[16]={}; uint8_t rows[16]={}; };
static double now(){ return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int M = atoi(argv[1]); int K = atoi(argv[2]); int mode = atoi(argv[3]); int epi = atoi(argv[4]);
  int8_t* LO = (int8_t*)aligned_alloc(64, (size_t)M*K); int8_t* HI = (int8_t*)aligned_alloc(64, (size_t)M*K);
  memset(LO, 1, (size_t)M*K); memset(HI, 1, (size_t)M*K);
  alignas(64) static uint8_t Bm[16384]; alignas(64) static int32_t Cm[8*1024*4];
  float* acc = (float*)aligned_alloc(64, M*16*4); memset(acc, 0, M*64);
  Cfg c; for (int t=0;t<8;++t){ c.rows[t]= (t==2||t==3)?16:16; c.colsb[t]=64; }
  _tile_loadconfig(&c);
  int nb = K/256, G = M/16; const int T = 20000 / G;
  auto EPI = [&](int i0, int i1) { /* previous group's */ }; (void)EPI;
  double t0=now();
  for (int t=0;t<T;++t) for (int b=0;b<nb;++b) for (int g=0; g<G; ++g) {
    auto EPI = [&](int i0, int i1) { const int lag = epi == 5 ? 2 : 1; const int32_t* Cp = Cm + ((g+G-lag)%G)*1024;
      for (int i=i0;i<i1;++i){ __m512i s=_mm512_add_epi32(_mm512_add_epi32(_mm512_load_si512(Cp+16*i), _mm512_slli_epi32(_mm512_load_si512(Cp+256+16*i),4)), _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(Cp+512+16*i),7), _mm512_slli_epi32(_mm512_load_si512(Cp+768+16*i),11)));
      float* ar = acc + 16*(16*((g+G-1)%G)+i);
      _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(1.5f), _mm512_loadu_ps(ar))); } };
    const int8_t* xl = LO + (size_t)g*16*K + b*256; const int8_t* xh = HI + (size_t)g*16*K + b*256;
    int32_t* C = Cm + g*1024;
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
      if (mode==1) { _tile_loadd(0, LO+ch*64, 256); _tile_loadd(1, HI+ch*64, 256);}   // A from one small L1 block
      else if (mode==2) { _tile_stream_loadd(0, xl+ch*64, K); _tile_stream_loadd(1, xh+ch*64, K);}
      else { _tile_loadd(0,xl+ch*64,K); _tile_loadd(1,xh+ch*64,K);}
      _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);
      if (epi == 4) EPI(ch*4, ch*4+4); }
    if (epi == 3 || epi == 5) EPI(0, 16);
    if (epi >= 1) { _tile_stored(4, C, 64); _tile_stored(5, C+256, 64); _tile_stored(6, C+512, 64); _tile_stored(7, C+768, 64); }
    asm volatile("" ::: "memory");
    if (epi == 2) { const int32_t* Cp = Cm + ((g+G-1)%G)*1024;  // previous group's C (pipelined)
      for (int i=0;i<16;++i){ __m512i s=_mm512_add_epi32(_mm512_add_epi32(_mm512_load_si512(Cp+16*i), _mm512_slli_epi32(_mm512_load_si512(Cp+256+16*i),4)), _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(Cp+512+16*i),7), _mm512_slli_epi32(_mm512_load_si512(Cp+768+16*i),11)));
      float* ar = acc + 16*(16*((g+G-1)%G)+i);
      _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(1.5f), _mm512_loadu_ps(ar))); } }
  }
  double t1=now();
  printf("M %d K %d mode %d epi %d: %.1f ns per group\n", M, K, mode, epi, (t1-t0)/T/nb/G*1e9);
  _tile_release();
  return acc[3] > 1e30;
}
