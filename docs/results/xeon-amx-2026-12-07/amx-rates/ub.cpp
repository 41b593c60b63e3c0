// The AMX tile instructions' rates on this CPU (throughput of tdpbsud, tileloadd, tilestored, tilezero, ldtilecfg; a
// group of the tile kernel: 4 chunks x (2 B, 2 A loads, 4 tdp)). Build: g++ -O2 -mamx-tile -mamx-int8 -mavx512f ub.cpp -o ub; ./ub ROWS
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <unistd.h>
#include <sys/syscall.h>
struct alignas(64) Cfg { uint8_t palette=1, start=0; uint8_t res[14]={}; uint16_t colsb[16]={}; uint8_t rows[16]={}; };
alignas(64) uint8_t A[64*1024], Bm[16*1024]; alignas(64) int32_t Cm[16*16*8];
static double now(){ return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int rows = argc > 1 ? atoi(argv[1]) : 16;
  Cfg c; for (int t=0;t<8;++t){ c.rows[t]= (t==2||t==3)?16:rows; c.colsb[t]=64; }
  _tile_loadconfig(&c);
  const int N=1000000; double t0, t1; const double ghz=1.0;
  _tile_loadd(0, A, 64); _tile_loadd(1, A, 64); _tile_loadd(2, Bm, 64); _tile_loadd(3, Bm, 64);
  t0=now(); for(int i=0;i<N;++i){ _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);} t1=now();
  printf("rows %d: tdp (4 indep) %.2f ns each\n", rows, (t1-t0)/N/4*1e9);
  t0=now(); for(int i=0;i<N;++i){ _tile_dpbsud(4,0,2); } t1=now();
  printf("tdp (dependent chain) %.2f ns each\n", (t1-t0)/N*1e9);
  t0=now(); for(int i=0;i<N;++i){ _tile_loadd(2, Bm + (i&7)*1024, 64); _tile_loadd(3, Bm+(i&7)*1024+512, 64);} t1=now();
  printf("tileloadd B (16 rows) %.2f ns each\n", (t1-t0)/N/2*1e9);
  t0=now(); for(int i=0;i<N;++i){ _tile_loadd(0, A + (i&15)*64, 1536); _tile_loadd(1, A+(i&15)*64+32768, 1536);} t1=now();
  printf("tileloadd A (%d rows stride 1536) %.2f ns each\n", rows, (t1-t0)/N/2*1e9);
  t0=now(); for(int i=0;i<N;++i){ _tile_stored(4, Cm, 64); _tile_stored(5, Cm+256, 64); _tile_stored(6, Cm+512, 64); _tile_stored(7, Cm+768, 64);} t1=now();
  printf("tilestored C %.2f ns each\n", (t1-t0)/N/4*1e9);
  t0=now(); for(int i=0;i<N;++i){ _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);} t1=now();
  printf("tilezero %.2f ns each\n", (t1-t0)/N/4*1e9);
  // full group: zero, 4 chunks of (2 B loads, 2 A loads, 4 tdp), 4 stores
  t0=now(); for(int i=0;i<N/10;++i){ _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for(int ch=0;ch<4;++ch){ _tile_loadd(2, Bm+ch*1024,64); _tile_loadd(3,Bm+4096+ch*1024,64); _tile_loadd(0,A+ch*64,1536); _tile_loadd(1,A+32768+ch*64,1536);
      _tile_dpbsud(4,0,2); _tile_dpbsud(5,0,3); _tile_dpbsud(6,1,2); _tile_dpbsud(7,1,3);}
    _tile_stored(4, Cm, 64); _tile_stored(5, Cm+256, 64); _tile_stored(6, Cm+512, 64); _tile_stored(7, Cm+768, 64);
    asm volatile("" ::: "memory"); } t1=now();
  printf("group (16 tdp) %.1f ns\n", (t1-t0)/(N/10)*1e9);
  t0=now(); for(int i=0;i<N;++i){ _tile_loadconfig(&c); } t1=now();
  printf("ldtilecfg %.1f ns\n", (t1-t0)/N*1e9);
  _tile_release();
}
