// One thread, one path: the K-quant / block-format tiles over an N x 1536 matrix that stays in L2 (N = 512: 0.45-0.65
// MB), best of 7 rounds of 200 calls, M = 1..32 rows. From the repository root:
//   H=draftwise/kernels/csrc; g++ -O3 -pthread -std=c++17 -ffp-contract=off -fno-fast-math -w -I$H \
//     kbench.cpp $H/core/*.cpp $H/arch/*/*.cpp $H/gguf/*.cpp -o kbench
//   ./kbench FORMAT 512 [Q6_K many-rows loop 0/1] [avx512vnni|avxvnni|avx2]   (FORMAT: 12 Q4_K, 14 Q6_K, 102 Q4_0,
//   106 Q5_0, 108 Q8_0). "per cycle": vpdpbusd-equivalents (64 multiply-adds) per cycle at 4.19 GHz, this Zen 5's clock.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include "core/kquant.h"
#include "core/qmm.h"
#include "gguf/repack.h"
namespace dw { const IsaOps* avx512vnni_ops(); const IsaOps* avx2_ops(); const IsaOps* avxvnni_ops(); }
int main(int argc, char** argv) {
  const int fmt = atoi(argv[1]);
  const int64_t N = atoi(argv[2]), K = 1536, nb = K / dw::kq_block_values(fmt), gb = dw::kq_gguf_block(fmt);
  const char* path = argc > 4 ? argv[4] : "avx512vnni";
  const dw::IsaOps* ops = !strcmp(path, "avx2") ? dw::avx2_ops() : !strcmp(path, "avxvnni") ? dw::avxvnni_ops() : dw::avx512vnni_ops();
  if (argc > 3) dw::kq6_set_many(atoi(argv[3]));
  std::mt19937 rng(1);
  std::vector<uint8_t> src(N * nb * gb);
  for (auto& b : src) b = rng();
  for (int64_t i = 0; i < N * nb; ++i) {  // sane fp16 d/dmin
    uint8_t* g = &src[i * gb];
    if (fmt == dw::kKq4 || fmt == dw::kKb41) { g[0] = 0; g[1] = 0x20; g[2] = 0; g[3] = 0x20; } else if (fmt == dw::kKq6) { g[208] = 0; g[209] = 0x20; } else { g[0] = 0; g[1] = 0x20; }
  }
  std::vector<uint8_t> w(dw::kq_bytes(fmt, N, K));
  dw::kq_pack_rows(fmt, src.data(), N, K, w.data(), 0, N);
  for (int M : {1, 2, 4, 5, 6, 8, 12, 16, 32}) {
    std::vector<float> x(M * K);
    for (auto& v : x) v = (float)(rng() % 1000) / 500.f - 1.f;
    std::vector<int8_t> q(M * K);
    std::vector<float> d(M * nb), out(M * N);
    std::vector<int32_t> b16n(M * (K / 16)), b32(M * (K / 32)), e32(M * (K / 32)), b32p(M * (K / 64));
    std::vector<uint8_t> e(M * (K / 32));
    std::vector<float> db(M * (K / 32));
    if (dw::kq_is_block(fmt)) { dw::act_q8b(x.data(), M, K, q.data(), db.data(), b32.data()); d = db; }
    else dw::act_q8k(x.data(), M, K, q.data(), d.data(), b16n.data(), b32.data(), e.data());
    if (!dw::kq_is_block(fmt)) dw::kq_act_lanes(0, M, K, b32.data(), e.data(), e32.data(), b32p.data());
    dw::KqArgs a{};
    a.M = M, a.K = K, a.N = N, a.fmt = fmt, a.w = w.data(), a.out = out.data();
    a.act = {q.data(), d.data(), b16n.data(), b32.data(), e.data(), e32.data(), b32p.data()};
    const int64_t tiles = dw::kq_tiles(N);
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {
      const int reps = 200;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) ops->qmm_k(a, 0, tiles);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
    }
    printf("fmt %d N %ld M %2d: %7.2f us  %5.0f GMAC/s  %.2f dpbusd/cycle\n", fmt, (long)N, M, best * 1e6, M * N * K / best / 1e9, M * N * K / best / 64 / 4.19e9);
  }
}
