// kernel compute-rate bench: Q4_K / Q6_K matrix in L2, M rows, one thread
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <vector>
#include <cmath>
#include <thread>
#include "core/qmm.h"
#include "core/kquant.h"
#include "gguf/repack.h"
static uint64_t st = 88172645463325252ull;
static uint32_t nx() { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return (uint32_t)st; }
int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "avx512vnni";
  int fmt = argc > 2 ? atoi(argv[2]) : 12;
  int64_t N = argc > 3 ? atol(argv[3]) : 256, K = argc > 4 ? atol(argv[4]) : 1536;
  int threads = argc > 5 ? atoi(argv[5]) : 1;
  if (argc > 6) dw::kq_set_prefetch_l2(fmt, atoi(argv[6]) != 0);
  const char* mlist = argc > 7 ? argv[7] : "1,2,4,8,16,32";
  const dw::IsaOps* ops = dw::path_by_name(path);
  if (!ops) { printf("no path %s\n", path); return 1; }
  const int64_t nb = K / dw::kq_block_values(fmt), gb = dw::kq_gguf_block(fmt);
  std::vector<uint8_t> src(N * nb * gb);
  for (auto& b : src) b = (uint8_t)nx();
  int off = fmt == 12 ? 0 : fmt == 14 ? 208 : 0;
  for (int64_t i = 0; i < N * nb; ++i) { uint16_t v = 0x1000 + (nx() & 0x3ff); memcpy(&src[i * gb + off], &v, 2); if (fmt == 12) memcpy(&src[i * gb + 2], &v, 2); }
  std::vector<uint8_t> w(dw::kq_bytes(fmt, N, K));
  dw::kq_pack_rows(fmt, src.data(), N, K, w.data(), 0, N);
  std::vector<int> Ms; for (const char* c = mlist; *c;) { Ms.push_back(atoi(c)); while (*c && *c != ',') ++c; if (*c) ++c; }
  for (int M : Ms) {
    std::vector<float> x(M * K);
    for (auto& v : x) v = (float)((int)(nx() % 2001) - 1000) / 300.f;
    std::vector<int8_t> q(M * K);
    std::vector<float> d(M * nb), out(M * N);
    std::vector<int32_t> b16n(M * (K / 16)), b32(M * (K / 32)), e32(M * (K / 32)), b32p(M * (K / 64));
    std::vector<uint8_t> e(M * (K / 32));
    if (dw::kq_is_block(fmt)) ops->act_b(x.data(), M, K, q.data(), d.data(), b32.data());
    else { ops->act_k(x.data(), M, K, q.data(), d.data(), b16n.data(), b32.data(), e.data());
      dw::kq_act_lanes(0, M, K, b32.data(), e.data(), e32.data(), b32p.data()); }
    dw::KqArgs a{};
    a.M = M, a.K = K, a.N = N, a.fmt = fmt, a.w = w.data(), a.out = out.data();
    bool blk = dw::kq_is_block(fmt);
    a.act = {q.data(), d.data(), b16n.data(), b32.data(), e.data(), blk ? nullptr : e32.data(), blk ? nullptr : b32p.data()};
    const int64_t tiles = dw::kq_tiles(N);
    double best = 1e9;
    int reps = (int)(2e8 / ((double)N * K * M)) + 3;
    for (int r = 0; r < 7; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) {
        if (threads == 1) ops->qmm_k(a, 0, tiles);
        else { std::vector<std::thread> th; for (int t = 0; t < threads; ++t) th.emplace_back([&, t] { ops->qmm_k(a, tiles * t / threads, tiles * (t + 1) / threads); }); for (auto& x : th) x.join(); }
      }
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
      if (t < best) best = t;
    }
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < out.size() * 4; ++i) h = (h ^ ((uint8_t*)out.data())[i]) * 1099511628211ull;
    printf("%s fmt %d N %ld K %ld M %2d: %8.1f us  %6.1f GMAC/s  %5.2f us/row  chk %016llx\n", path, fmt, (long)N, (long)K, M, best * 1e6,
           (double)N * K * M / best / 1e9, best * 1e6 / M, (unsigned long long)h);
  }
}
