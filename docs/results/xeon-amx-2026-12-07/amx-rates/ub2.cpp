// One group of the tile kernel over a row of super-blocks (A rows strided by K), with and without a float step per
// row. Build: g++ -O2 -mamx-tile -mamx-int8 -mavx512f ub2.cpp -o ub2; ./ub2 ROWS K EPILOGUE(0|1)
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <chrono>
#include <unistd.h>
#include <sys/syscall.h>
struct alignas(64) Cfg { uint8_t palette=1, start=0; uint8_t res[14]={}; uint16_t colsb[16]={}; uint8_t rows[16]={}; };
alignas(64) int8_t LO[32*8960], HI[32*8960]; alignas(64) uint8_t Bm[16384]; alignas(64) int32_t Cm[4096];
static double now(){ return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int rows = atoi(argv[1]); int K = atoi(argv[2]); int epi = atoi(argv[3]);
  Cfg c; for (int t=0;t<8;++t){ c.rows[t]= (t==2||t==3)?16:rows; c.colsb[t]=64; }
  _tile_loadconfig(&c);
  int nb = K/256; const int T = 20000; float acc[16*16]={};
  double t0=now();
  for (int t=0;t<T;++t) for (int b=0;b<nb;++b) {
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64); _tile_loadd(0,LO+b*256+ch*64,K); _tile_loadd(1,HI+b*256+ch*64,K);
      _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);}
    _tile_stored(4, Cm, 64); _tile_stored(5, Cm+256, 64); _tile_stored(6, Cm+512, 64); _tile_stored(7, Cm+768, 64);
    asm volatile("" ::: "memory");
    if (epi) for (int i=0;i<rows;++i){ __m512i s=_mm512_add_epi32(_mm512_add_epi32(_mm512_load_si512(Cm+16*i), _mm512_slli_epi32(_mm512_load_si512(Cm+256+16*i),4)), _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(Cm+512+16*i),7), _mm512_slli_epi32(_mm512_load_si512(Cm+768+16*i),11)));
      _mm512_storeu_ps(acc+16*i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(1.5f), _mm512_loadu_ps(acc+16*i))); }
  }
  double t1=now();
  printf("rows %d K %d epi %d: %.1f ns per sb-tile group\n", rows, K, epi, (t1-t0)/T/nb*1e9);
  _tile_release();
  return acc[3] > 1e30;
}
