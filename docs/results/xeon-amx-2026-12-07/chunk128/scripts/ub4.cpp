// Build: g++ -O2 -mamx-tile -mamx-int8 -mavx512f ub4.cpp -o ub4; ./ub4 M K VARIANT
// per-group orderings of the Q4_K tile work (16 tdp, C stored per group), A (M x K) strided, B in L1
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
  int M = atoi(argv[1]); int K = atoi(argv[2]); int v = atoi(argv[3]);
  int8_t* LO = (int8_t*)aligned_alloc(64, (size_t)M*K); int8_t* HI = (int8_t*)aligned_alloc(64, (size_t)M*K);
  memset(LO, 1, (size_t)M*K); memset(HI, 1, (size_t)M*K);
  alignas(64) static uint8_t Bm[16384]; alignas(64) static int32_t Cm[16*1024];
  memset(Bm, 1, sizeof Bm);
  Cfg c; for (int t=0;t<8;++t){ c.rows[t]=16; c.colsb[t]=64; }
  _tile_loadconfig(&c);
  int nb = K/256, G = M/16; const int T = 40000 / G / nb * 6;
  double t0=now();
  for (int t=0;t<T;++t) for (int b=0;b<nb;++b) for (int g=0; g<G; ++g) {
    const int8_t* xl = LO + (size_t)g*16*K + b*256; const int8_t* xh = HI + (size_t)g*16*K + b*256;
    int32_t* C = Cm + (g&1)*4096 + 0;
    if (v == 0) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_loadd(1,xh+ch*64,K);
        _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);}
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64); _tile_stored(6, C+512, 64); _tile_stored(7, C+768, 64);
    } else if (v == 1) {  // two passes: lo (C0, C1) then hi (C2, C3); each pass's C stored while the other runs
      _tile_zero(4); _tile_zero(5);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); }
      _tile_stored(6, C+512-4096*(0), 64); _tile_stored(7, C+768, 64);  // previous group's hi (timing only)
      _tile_zero(6); _tile_zero(7);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(1,xh+ch*64,K); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3); }
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64);
    } else if (v == 8) {  // two passes, A alternating tmm0 / tmm1 within a pass
      _tile_zero(4); _tile_zero(5);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        if (ch & 1) { _tile_loadd(1,xl+ch*64,K); _tile_dpbsud(4,1,2); _tile_dpbsud(5,1,3); }
        else { _tile_loadd(0,xl+ch*64,K); _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); } }
      _tile_stored(6, C+512, 64); _tile_stored(7, C+768, 64);
      _tile_zero(6); _tile_zero(7);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        if (ch & 1) { _tile_loadd(0,xh+ch*64,K); _tile_dpbsud(6,0,2); _tile_dpbsud(7,0,3); }
        else { _tile_loadd(1,xh+ch*64,K); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3); } }
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64);
    } else if (v == 9) {  // two passes, B1 of a pass's chunk order reversed in the second (B reuse across the pass boundary)
      _tile_zero(4); _tile_zero(5);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); }
      _tile_stored(6, C+512, 64); _tile_stored(7, C+768, 64);
      _tile_zero(6); _tile_zero(7);
      _tile_loadd(1,xh+3*64,K); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);
      for(int ch=2;ch>=0;--ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(1,xh+ch*64,K); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3); }
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64);
    } else if (v == 2) {  // A lo/hi loads hoisted: chunk pairs alternate B tiles? (B1 of chunk in 2, B2 in 3), A in 0/1
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for(int ch=0;ch<4;++ch){ _tile_loadd(0,xl+ch*64,K); _tile_loadd(2, Bm+ch*1024,64);
        _tile_dpbsud(4,0,2); _tile_loadd(1,xh+ch*64,K); _tile_dpbsud(6,1,2); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_dpbsud(5,0,3); _tile_dpbsud(7,1,3);}
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64); _tile_stored(6, C+512, 64); _tile_stored(7, C+768, 64);
    } else if (v == 6) {  // 3 C tiles (the Q6_K scheme): C0 = lo.B1, C1 = hi.B1 + lo.B2, C2 = hi.B2
      _tile_zero(4); _tile_zero(5); _tile_zero(6);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_loadd(1,xh+ch*64,K);
        _tile_dpbsud(4,0,2); _tile_dpbsud(5,1,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,3);}
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64); _tile_stored(6, C+512, 64);
    } else if (v == 7) {  // 3 C tiles, A lo double-buffered in tmm7 for odd chunks
      _tile_zero(4); _tile_zero(5); _tile_zero(6);
      for(int ch=0;ch<4;ch+=2){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_loadd(1,xh+ch*64,K);
        _tile_dpbsud(4,0,2); _tile_dpbsud(5,1,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,3);
        _tile_loadd(7,xl+ch*64+64,K); _tile_loadd(2, Bm+(ch+1)*1024,64); _tile_loadd(3,Bm+4096+(ch+1)*1024,64); _tile_loadd(1,xh+ch*64+64,K);
        _tile_dpbsud(4,7,2); _tile_dpbsud(5,1,2); _tile_dpbsud(5,7,3); _tile_dpbsud(6,1,3);}
      _tile_stored(4, C, 64); _tile_stored(5, C+256, 64); _tile_stored(6, C+512, 64);
    } else if (v == 3) {  // no stores (floor)
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_loadd(1,xh+ch*64,K);
        _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);}
    } else if (v == 4) {  // no stores, no zero: pure 16 tdp + loads
      for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64);
        _tile_loadd(0,xl+ch*64,K); _tile_loadd(1,xh+ch*64,K);
        _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);}
    } else if (v == 5) {  // tdp only
      for(int ch=0;ch<4;++ch){ _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);}
    }
    asm volatile("" ::: "memory");
  }
  double t1=now();
  printf("M %d K %d v %d: %.1f ns per group\n", M, K, v, (t1-t0)/T/nb/G*1e9);
  _tile_release();
  return Cm[3] == 12345;
}
