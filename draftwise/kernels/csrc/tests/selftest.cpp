// Stand-alone check of the kernel core, without torch: every path this CPU can run must compute the same
// bits as the scalar reference, for every weight format and both activation kinds, and for any number of
// rows (batch invariance). Prints one checksum per case; the checksums are the same on every CPU and
// architecture (tests/test_kernels.py pins them, and the ARM build is checked under qemu-user, see
// docs/kernels.md). Build: see draftwise/kernels/build_selftest.sh. Exit status 1 on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <string>
#include <atomic>
#include <thread>
#include <vector>

#include "arch/x86/amx.h"
#include "core/kquant.h"
#include "core/pool.h"
#include "core/qmm.h"
#include "gguf/repack.h"

namespace {

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {  // xorshift64*: the same stream everywhere
  rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}
float next_f() { return ((float)(next_u32() >> 8) / 16777216.0f) * 2.0f - 1.0f; }  // exact, in [-1, 1)

uint64_t fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const uint8_t* b = (const uint8_t*)p;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

struct Case {
  const char* name;
  int64_t N, K, G, bits;
  bool minv;
  int act_bits;
};

// out (M, N) of one case on one path
std::vector<float> run(const dw::IsaOps* ops, const Case& c, const std::vector<uint8_t>& q, const std::vector<float>& s,
                       const std::vector<float>& mn, const std::vector<float>& x, int64_t M) {
  dw::QmmArgs a{};
  a.M = M, a.K = c.K, a.N = c.N, a.G = c.G, a.bits = c.bits;
  a.q = q.data(), a.scale = s.data(), a.minv = c.minv ? mn.data() : nullptr, a.x = x.data();
  std::vector<float> out(M * c.N);
  a.out = out.data();
  const bool q8 = c.act_bits == 8 && dw::q8_supported(c.bits, c.K, c.G);
  const dw::ActQ8Sizes sz = dw::act_sizes(M, c.K, c.G, c.bits);
  std::vector<int8_t> xq(sz.q);
  std::vector<float> lane(sz.lane), gs(sz.gs), xsum(M * (c.K / c.G));
  std::vector<int32_t> bias(sz.lane);
  if (q8) {
    ops->quantize_act(x.data(), M, c.K, c.G, c.bits, xq.data(), lane.data(), bias.data(), gs.data());
    a.act = {xq.data(), lane.data(), bias.data(), gs.data()};
  } else {
    dw::group_sums(x.data(), M, c.K, c.G, xsum.data());
    a.xsum = xsum.data();
  }
  dw::qmm_columns(ops, a, q8, 0, c.N / 2);  // two column ranges, as threads would split them
  dw::qmm_columns(ops, a, q8, c.N / 2, c.N);
  return out;
}

// Each path's activation quantization gives the reference's buffers, byte for byte (codes in kernel order,
// lane scales, int8 biases, group sums), including tail steps, all-zero blocks, huge values and ties.
int check_quantize_act(const char* const* names, int npaths) {
  struct Shape { int64_t K, G, bits; };
  const Shape shapes[] = {{256, 32, 4}, {192, 32, 4}, {512, 16, 8}, {224, 32, 8}, {96, 16, 8}, {8960, 16, 8}, {1536, 32, 4}};
  int failures = 0;
  for (const Shape& sh : shapes) {
    const int64_t M = 3;
    std::vector<float> x(M * sh.K);
    for (auto& v : x) v = next_f() * 5.0f;
    for (int64_t k = 0; k < 32; ++k) x[k] = 0.f;                              // an all-zero block
    x[40] = -0.0f, x[sh.K + 7] = 3e38f, x[sh.K + 8] = -1e-40f;                 // signed zero, huge, denormal
    for (int64_t k = 0; k < 32; ++k) x[2 * sh.K + k] = (float)(k - 16) + 0.5f;  // amax 15.5: many ties
    x[2 * sh.K + 3] = 127.0f;                                                  // inv = 1: exact halves tie
    const dw::ActQ8Sizes sz = dw::act_sizes(M, sh.K, sh.G, sh.bits);
    auto quantize = [&](const dw::IsaOps* ops, std::vector<int8_t>& q, std::vector<float>& lane,
                        std::vector<int32_t>& bias, std::vector<float>& gs) {
      q.assign(sz.q, 0x55), lane.assign(sz.lane, -1.f), bias.assign(sz.lane, 12345), gs.assign(sz.gs, -1.f);
      ops->quantize_act(x.data(), M, sh.K, sh.G, sh.bits, q.data(), lane.data(), bias.data(), gs.data());
    };
    std::vector<int8_t> rq, pq;
    std::vector<float> rl, rg, pl, pg;
    std::vector<int32_t> rb, pb;
    quantize(&dw::kScalar, rq, rl, rb, rg);
    for (int p = 0; p < npaths; ++p) {
      quantize(dw::path_by_name(names[p]), pq, pl, pb, pg);
      if (pq != rq || std::memcmp(pl.data(), rl.data(), rl.size() * 4) || pb != rb ||
          std::memcmp(pg.data(), rg.data(), rg.size() * 4)) {
        std::printf("MISMATCH quantize_act K=%lld G=%lld bits=%lld on path %s\n", (long long)sh.K, (long long)sh.G,
                    (long long)sh.bits, names[p]);
        ++failures;
      }
    }
  }
  return failures;
}

// Each path's silu_mul gives the reference's bits (NaN where the reference gives NaN), over the whole
// range of the exp polynomial, its cut-offs and special values, and a row length with a tail.
int check_silu_mul(const char* const* names, int npaths) {
  const int64_t M = 2, F = 1003;
  std::vector<float> gu(M * 2 * F);
  for (auto& v : gu) v = next_f();
  const float special[] = {0.f, -0.f, 87.0f, -87.0f, 87.0001f, -87.0001f, 88.72283f, -88.72283f, 88.5f, -88.5f, 88.7228f,
                           -88.7229f, 100.f, -100.f, 1e30f, -1e30f, __builtin_inff(), -__builtin_inff(), __builtin_nanf("")};
  for (int64_t j = 0; j < F; ++j) gu[j] = -110.0f + 220.0f * (float)j / (float)F;  // row 0 gates: the full range
  for (size_t j = 0; j < sizeof(special) / sizeof(float); ++j) gu[2 * F + j] = special[j];  // row 1 gates
  std::vector<float> ref(M * F), out(M * F);
  dw::silu_mul(gu.data(), M, F, ref.data());
  int failures = 0;
  for (int p = 0; p < npaths; ++p) {
    std::fill(out.begin(), out.end(), -1.f);
    for (int64_t m = 0; m < M; ++m)  // a row in two spans, the first ending mid-vector
      for (int64_t j0 : {(int64_t)0, (int64_t)517})
        dw::path_by_name(names[p])->silu_mul(gu.data() + m * 2 * F + j0, gu.data() + m * 2 * F + F + j0,
                                             j0 ? F - j0 : 517, out.data() + m * F + j0);
    for (int64_t j = 0; j < M * F; ++j)
      if (std::memcmp(&out[j], &ref[j], 4) && !(out[j] != out[j] && ref[j] != ref[j])) {
        std::printf("MISMATCH silu_mul on path %s: gate %g gives %g, reference %g\n", names[p],
                    gu[(j / F) * 2 * F + j % F], out[j], ref[j]);
        ++failures;
        break;
      }
  }
  return failures;
}

// Each path's decode attention gives the reference's bits: causal and tree-masked, head sizes 64 and 128
// (their register tiles), 96 (one key at a time) and 80 (which every path hands to the reference), key
// counts below and above 16, two rows. 96 comes last and puts the random stream back, so that the
// checksums drawn after this check stay as pinned.
int check_attention(const char* const* names, int npaths) {
  int failures = 0;
  uint64_t stream = 0;  // the random stream's state before the 96 case
  for (int64_t hd : {64, 128, 80, 96}) {
    if (hd == 96) stream = rng_state;
    const int64_t B = 2, T = 4, nh = 6, nkv = 2, cap = 64, W = (nh + 2 * nkv) * hd;
    std::vector<float> qkv(B * T * W), kc(B * nkv * cap * hd), vc(kc.size()), ref(B * T * nh * hd), out(ref.size()),
        p(dw::attend_scratch(nh / nkv, T, cap));
    for (auto& v : qkv) v = next_f() * 2.0f;
    for (auto& v : kc) v = next_f() * 2.0f;
    for (auto& v : vc) v = next_f();
    const int64_t start[2] = {3, 37};
    // a tree over the 4 new tokens: 0 root; 1 and 2 children of 0; 3 child of 2
    const int64_t vis1[16] = {0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 2, 3, 0}, nvis1[4] = {1, 2, 2, 3};
    std::vector<int64_t> vis(B * T * T), nvis(B * T);
    for (int64_t b = 0; b < B; ++b) {
      std::copy(vis1, vis1 + 16, vis.begin() + b * 16);
      std::copy(nvis1, nvis1 + 4, nvis.begin() + b * 4);
    }
    for (int tree = 0; tree < 2; ++tree) {
      const int64_t* vp = tree ? vis.data() : nullptr;
      const int64_t* np = tree ? nvis.data() : nullptr;
      dw::attend_items(qkv.data(), kc.data(), vc.data(), start, B, T, nh, nkv, hd, cap, ref.data(), 0, B * T * nh,
                       p.data(), vp, np);
      for (int q = 0; q < npaths; ++q) {
        const dw::IsaOps* ops = dw::path_by_name(names[q]);
        // whole KV groups, single heads; one token, all four, chunks of three (the last one short)
        for (int64_t hc : {nh / nkv, (int64_t)1})
          for (int64_t tc : {(int64_t)1, T, (int64_t)3}) {
            std::fill(out.begin(), out.end(), -1.f);
            // two calls, as threads would split the groups (odd split: a row's groups on both sides)
            const int64_t groups = dw::attend_groups_count(B, T, nh, hc, tc);
            ops->attend_groups(qkv.data(), kc.data(), vc.data(), start, B, T, nh, nkv, hd, cap, hc, tc, out.data(), 0, 3,
                               p.data(), vp, np);
            ops->attend_groups(qkv.data(), kc.data(), vc.data(), start, B, T, nh, nkv, hd, cap, hc, tc, out.data(), 3,
                               groups, p.data(), vp, np);
            if (std::memcmp(out.data(), ref.data(), ref.size() * 4)) {
              std::printf("MISMATCH attention hd=%lld tree=%d heads/group=%lld tokens/group=%lld on path %s\n",
                          (long long)hd, tree, (long long)hc, (long long)tc, names[q]);
              ++failures;
            }
          }
      }
    }
  }
  rng_state = stream;
  // heads, then tokens per group: whole KV groups and all tokens when they split evenly over the threads, else
  // smaller ones
  const int64_t want[][7] = {{1, 1, 12, 2, 2, 6, 1}, {1, 4, 12, 2, 2, 6, 4}, {1, 1, 9, 3, 2, 1, 1},
                             {1, 1, 8, 1, 2, 4, 1}, {2, 1, 14, 2, 2, 7, 1}, {1, 8, 12, 2, 16, 6, 1},
                             {1, 8, 8, 1, 2, 8, 4}, {1, 5, 9, 3, 2, 3, 3}, {1, 8, 9, 3, 2, 3, 4}};
  for (const auto& w : want) {
    int64_t hc, tc;
    dw::attend_split(w[0], w[1], w[2], w[3], w[4], &hc, &tc);
    if (hc != w[5] || tc != w[6]) {
      std::printf("attend_split(B=%lld, T=%lld, nh=%lld, nkv=%lld, threads=%lld) = (%lld, %lld), not (%lld, %lld)\n",
                  (long long)w[0], (long long)w[1], (long long)w[2], (long long)w[3], (long long)w[4], (long long)hc,
                  (long long)tc, (long long)w[5], (long long)w[6]);
      ++failures;
    }
  }
  return failures;
}


// the thread pool (pool.h): every item exactly once, for many sizes, thread counts and grains, also with
// two callers at once (the second runs its items on its own thread) and many calls in a row
int check_pool() {
  int failures = 0;
  auto one = [&](int64_t n, int64_t grain, int threads) {
    std::vector<std::atomic<int>> hits(n > 0 ? n : 1);
    for (auto& h : hits) h.store(0);
    dw::parallel_for(n, grain, threads, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) hits[i].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i)
      if (hits[i].load() != 1) return 1;
    return 0;
  };
  for (int threads : {1, 2, 3, 8})
    for (int64_t grain : {1, 16, 64})
      for (int64_t n : {0, 1, 2, 7, 16, 17, 100, 1000, 17920}) failures += one(n, grain, threads);
  for (int r = 0; r < 2000; ++r) failures += one(64, 1, 2);  // back to back: helpers spinning and waking
  std::atomic<int> other{0};
  std::thread t([&] { for (int r = 0; r < 200; ++r) other += one(997, 1, 4); });
  for (int r = 0; r < 200; ++r) failures += one(1003, 1, 4);
  t.join();
  failures += other.load();
  std::printf("%-20s %s\n", "thread pool", failures ? "FAIL" : "ok");
  return failures ? 1 : 0;
}


// GGUF re-packing (repack.h): random blocks of every format with finite fp16 scales (normal, subnormal,
// negative), re-packed in two row ranges; one checksum over every output (pinned: the same on ARM)
uint64_t check_repack() {
  uint64_t st = 0x243F6A8885A308D3ull, h = 1469598103934665603ull;
  auto u32 = [&] { st ^= st >> 12, st ^= st << 25, st ^= st >> 27; return (uint32_t)((st * 0x2545F4914F6CDD1Dull) >> 32); };
  const int types[] = {dw::kQ4_0, dw::kQ4_1, dw::kQ5_0, dw::kQ8_0, dw::kQ4_K, dw::kQ5_K, dw::kQ6_K};
  for (int type : types) {
    dw::RepackFormat f;
    if (!dw::repack_format(type, &f)) return 0;
    const int64_t N = 5, K = 512, nb = N * (K / f.block_values);
    std::vector<uint8_t> src(nb * f.block_bytes);
    for (auto& b : src) b = (uint8_t)u32();
    const int64_t halves[3] = {type == dw::kQ6_K ? 208 : 0, 2, -1};  // byte offsets of fp16 fields in a block
    for (int64_t i = 0; i < nb; ++i)
      for (int k = 0; k < (type == dw::kQ4_1 || type == dw::kQ4_K || type == dw::kQ5_K ? 2 : 1); ++k) {
        uint16_t v = (uint16_t)(u32() & 0xBBFF);  // sign, exponent < 31: finite
        if (i % 7 == 3) v = (uint16_t)(v & 0x83FF);  // exponent 0: subnormal
        std::memcpy(&src[i * f.block_bytes + halves[k]], &v, 2);
      }
    std::vector<uint8_t> q(N * K * f.bits / 8);
    std::vector<float> sc(N * (K / f.group)), mn(f.has_min ? sc.size() : 0);
    dw::repack_rows(type, src.data(), K, q.data(), sc.data(), f.has_min ? mn.data() : nullptr, 0, 2);
    dw::repack_rows(type, src.data(), K, q.data(), sc.data(), f.has_min ? mn.data() : nullptr, 2, N);
    h = fnv(q.data(), q.size(), fnv(sc.data(), sc.size() * 4, fnv(mn.data(), mn.size() * 4, h)));
  }
  return h;
}

// The K-quant rule (kquant.h): random GGUF Q4_K / Q6_K blocks (finite fp16 scales: normal, subnormal,
// negative) re-laid out in two row ranges, N = 37 (a partial tile) and 32; every path must equal the
// reference for 13 rows and for rows alone, and so must the AMX tile kernel on emulated tiles (arch/x86/amx.h, on
// every CPU); the reference is checked loosely against doubles. Prints one checksum per format (pinned:
// the same on ARM).
const dw::IsaOps* amx_emulated_ops() {
  static const dw::IsaOps ops = [] {
    dw::IsaOps o = dw::kScalar;
    o.name = "amx-emulated", o.qmm_k = dw::kq_amx_emulated;
    return o;
  }();
  return &ops;
}

// The checks both K-quant tests make of one weight matrix: run(ops, x, rows) gives a path's (rows, N) output.
// The scalar reference's output (returned) for M rows, every path's and the AMX path's call (emulated) equal
// to it for the M rows and for rows alone, and the reference within 2 % of doubles over the de-quantized
// weights wd for row 2. `what`: the case's name in messages.
template <class Run>
std::vector<float> check_every_path(const char* what, int64_t N, int64_t K, int64_t M, const char* const* names,
                                    int npaths, const Run& run, const std::vector<float>& x,
                                    const std::vector<float>& wd, bool* ok) {
  const std::vector<float> ref = run(&dw::kScalar, x.data(), M);
  // every path, then the AMX path's call on emulated tiles; each with Q6_K's many-rows loop and without (dw::kq6_many)
  for (int q = 0; q < 2 * (npaths + 1); ++q) {
    const int p = q / 2;
    const bool many = q % 2 == 0;
    dw::kq6_set_many(many);
    const dw::IsaOps* ops = p < npaths ? dw::path_by_name(names[p]) : amx_emulated_ops();
    if (std::memcmp(run(ops, x.data(), M).data(), ref.data(), ref.size() * 4)) {
      std::printf("MISMATCH %s N=%lld on path %s%s\n", what, (long long)N, ops->name, many ? "" : " (Q6_K few-rows loop)");
      *ok = false;
    }
    for (int64_t m : {0, 1, 12}) {
      if (std::memcmp(run(ops, x.data() + m * K, 1).data(), ref.data() + m * N, N * 4)) {
        std::printf("NOT BATCH-INVARIANT %s on path %s (row %lld)\n", what, ops->name, (long long)m);
        *ok = false;
      }
    }
    for (int64_t rows : {5, 6, 7, 8}) {  // 5, 6: one pass of more rows than a longer call takes (KQ_MB1, KQ6_FEW1); 7: 4 + 3; 8
      if (rows < M && std::memcmp(run(ops, x.data(), rows).data(), ref.data(), rows * N * 4)) {
        std::printf("NOT BATCH-INVARIANT %s on path %s%s (the first %lld rows)\n", what, ops->name,
                    many ? "" : " (Q6_K few-rows loop)", (long long)rows);
        *ok = false;
      }
    }
  }
  dw::kq6_set_many(true);
  double err = 0, mag = 0;  // the reference against doubles: de-quantized weights times row 2
  for (int64_t n = 0; n < N; ++n) {
    double dsum = 0;
    for (int64_t k = 0; k < K; ++k) dsum += (double)wd[n * K + k] * x[2 * K + k];
    err = std::fmax(err, std::fabs(dsum - ref[2 * N + n]));
    mag = std::fmax(mag, std::fabs(dsum));
  }
  if (!(err <= 0.02 * mag)) {
    std::printf("INACCURATE %s: max error %g of %g\n", what, err, mag);
    *ok = false;
  }
  return ref;
}

// n random GGUF blocks of gb bytes whose fp16 scales (at byte offsets `halves`) are finite: normal, subnormal
// (every 7th block), negative, |d| < 2^-6 so that the products' sums stay in range
std::vector<uint8_t> random_gguf_blocks(int64_t n, int64_t gb, std::initializer_list<int> halves) {
  std::vector<uint8_t> src(n * gb);
  for (auto& b : src) b = (uint8_t)next_u32();
  for (int64_t i = 0; i < n; ++i)
    for (int off : halves) {
      uint16_t v = (uint16_t)(next_u32() & 0xBBFF);  // finite
      if (i % 7 == 3) v = (uint16_t)(v & 0x83FF);    // subnormal
      v = (uint16_t)((v & 0x8000) | ((v & 0x7FFF) % 0x2400));
      std::memcpy(&src[i * gb + off], &v, 2);
    }
  return src;
}

int check_kquant(const char* const* names, int npaths) {
  int failures = 0;
  for (int fmt : {dw::kKq4, dw::kKq6}) {
    uint64_t h = 1469598103934665603ull;
    bool ok = true;
    for (int64_t N : {37, 32}) {
      const int64_t K = 512, M = 13, nb = K / dw::QK, gb = dw::kq_gguf_block(fmt);
      const std::vector<uint8_t> src = fmt == dw::kKq4 ? random_gguf_blocks(N * nb, gb, {0, 2})
                                                      : random_gguf_blocks(N * nb, gb, {208});
      std::vector<uint8_t> w(dw::kq_bytes(fmt, N, K));
      dw::kq_pack_rows(fmt, src.data(), N, K, w.data(), 0, 5);
      dw::kq_pack_rows(fmt, src.data(), N, K, w.data(), 5, N);
      std::vector<float> x(M * K);
      for (auto& v : x) v = next_f() * 3.0f;
      for (int64_t k = 0; k < 256; ++k) x[k] = 0.f;  // an all-zero activation block
      x[K + 5] = 1e4f;                                // a block with one huge value
      for (int64_t k = 0; k < 256; ++k) x[2 * K + k] *= std::ldexp(1.0f, -(int)(k / 32));  // blocks of 32 at 2^-j:
      x[3 * K + 40] = 40.f;  // shifts 3, 2, 1, 0, 0, ...; an outlier: the rest of its super-block refined by 2^3
      auto run = [&](const dw::IsaOps* ops, const float* xp, int64_t rows) {
        std::vector<int8_t> q(rows * K);
        std::vector<float> d(rows * nb), out(rows * N);
        std::vector<int32_t> b16n(rows * (K / 16)), b32(rows * (K / 32));
        std::vector<uint8_t> e(rows * (K / 32));
        ops->act_k(xp, rows, K, q.data(), d.data(), b16n.data(), b32.data(), e.data());
        std::vector<int8_t> rq(rows * K);  // the path's activations: the reference's, every array
        std::vector<float> rd(rows * nb);
        std::vector<int32_t> r16(rows * (K / 16)), r32(rows * (K / 32));
        std::vector<uint8_t> re(rows * (K / 32));
        dw::act_q8k(xp, rows, K, rq.data(), rd.data(), r16.data(), r32.data(), re.data());
        if (rq != q || std::memcmp(rd.data(), d.data(), d.size() * 4) || r16 != b16n || r32 != b32 || re != e) {
          std::printf("MISMATCH act_k on path %s\n", ops->name);
          ok = false;
        }
        std::vector<int32_t> e32(rows * (K / 32)), b32p(rows * (K / 64));
        dw::kq_act_lanes(0, rows, K, b32.data(), e.data(), e32.data(), b32p.data());
        dw::KqArgs a{};
        a.M = rows, a.K = K, a.N = N, a.fmt = fmt, a.w = w.data(), a.out = out.data();
        a.act = {q.data(), d.data(), b16n.data(), b32.data(), e.data(), e32.data(), b32p.data()};
        const int64_t tiles = dw::kq_tiles(N);
        ops->qmm_k(a, 0, 1);
        ops->qmm_k(a, 1, tiles);
        return out;
      };
      std::vector<float> wd(N * K);
      dw::kq_dequant_rows(fmt, w.data(), N, K, wd.data(), 0, N);
      char what[32];
      std::snprintf(what, sizeof what, "kquant-%d", fmt);
      const std::vector<float> ref = check_every_path(what, N, K, M, names, npaths, run, x, wd, &ok);
      h = fnv(w.data(), w.size(), fnv(ref.data(), ref.size() * 4, h));
    }
    std::printf("%-20s %016llx %s\n", fmt == dw::kKq4 ? "kquant-q4k" : "kquant-q6k", (unsigned long long)h,
                ok ? "ok" : "FAIL");
    failures += !ok;
  }
  return failures;
}

// The block formats (kquant.h BLOCK FORMATS): random GGUF Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks re-laid out in two
// row ranges, N = 37 (a partial tile) and 32, K = 160 (five blocks: not a multiple of 64); the layout's
// de-quantization must equal the GGUF's own formulas decoded here from the file's bytes, every path's
// activations (act_b) and product the reference's for 13 rows and for rows alone (and the AMX path's call,
// which runs these formats on AVX512-VNNI), and the reference must be close to doubles. One checksum per
// format (pinned: the same on ARM).
float gguf_block_value(int fmt, const uint8_t* g, int v) {  // value v of one GGUF block: ggml's formulas
  const float d = dw::half_to_float((uint16_t)(g[0] | (g[1] << 8)));
  if (fmt == dw::kKb80) return d * (float)(int8_t)g[2 + v];
  const uint8_t* qs = g + (fmt == dw::kKb40 ? 2 : fmt == dw::kKb41 ? 4 : 6);
  int u = v < 16 ? (qs[v] & 15) : (qs[v - 16] >> 4);
  if (fmt == dw::kKb50) {
    const uint32_t qh = (uint32_t)g[2] | ((uint32_t)g[3] << 8) | ((uint32_t)g[4] << 16) | ((uint32_t)g[5] << 24);
    u |= (int)((qh >> v) & 1) << 4;
  }
  if (fmt == dw::kKb41) return d * (float)u + dw::half_to_float((uint16_t)(g[2] | (g[3] << 8)));
  return d * (float)(u - (fmt == dw::kKb40 ? 8 : fmt == dw::kKb50 ? 16 : 0));
}

int check_kblock(const char* const* names, int npaths) {
  int failures = 0;
  for (int fmt : {dw::kKb40, dw::kKb41, dw::kKb50, dw::kKb80}) {
    uint64_t h = 1469598103934665603ull;
    bool ok = true;
    for (int64_t N : {37, 32}) {
      const int64_t K = 160, M = 13, nb = K / dw::KB, gb = dw::kq_gguf_block(fmt);
      const std::vector<uint8_t> src = fmt == dw::kKb41 ? random_gguf_blocks(N * nb, gb, {0, 2})
                                                       : random_gguf_blocks(N * nb, gb, {0});
      std::vector<uint8_t> w(dw::kq_bytes(fmt, N, K));
      dw::kq_pack_rows(fmt, src.data(), N, K, w.data(), 0, 5);
      dw::kq_pack_rows(fmt, src.data(), N, K, w.data(), 5, N);
      std::vector<float> wd(N * K);
      dw::kq_dequant_rows(fmt, w.data(), N, K, wd.data(), 0, N);
      for (int64_t n = 0; n < N && ok; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const float want = gguf_block_value(fmt, &src[(n * nb + k / 32) * gb], (int)(k % 32));
          if (std::memcmp(&want, &wd[n * K + k], 4)) {
            std::printf("MISMATCH kblock-%d layout: row %lld value %lld\n", fmt, (long long)n, (long long)k);
            ok = false;
            break;
          }
        }
      std::vector<float> x(M * K);
      for (auto& v : x) v = next_f() * 3.0f;
      for (int64_t k = 0; k < 32; ++k) x[k] = 0.f;  // an all-zero activation block
      x[K + 5] = 1e4f;                               // a block with one huge value
      auto run = [&](const dw::IsaOps* ops, const float* xp, int64_t rows) {
        std::vector<int8_t> q(rows * K), rq(rows * K);
        std::vector<float> d(rows * nb), rd(rows * nb), out(rows * N);
        std::vector<int32_t> bs(rows * nb), rbs(rows * nb);
        ops->act_b(xp, rows, K, q.data(), d.data(), bs.data());
        dw::act_q8b(xp, rows, K, rq.data(), rd.data(), rbs.data());
        if (rq != q || std::memcmp(rd.data(), d.data(), d.size() * 4) || rbs != bs) {
          std::printf("MISMATCH act_b on path %s\n", ops->name);
          ok = false;
        }
        dw::KqArgs a{};
        a.M = rows, a.K = K, a.N = N, a.fmt = fmt, a.w = w.data(), a.out = out.data();
        a.act = {q.data(), d.data(), nullptr, bs.data(), nullptr};
        const int64_t tiles = dw::kq_tiles(N);
        ops->qmm_k(a, 0, 1);
        ops->qmm_k(a, 1, tiles);
        return out;
      };
      char what[32];
      std::snprintf(what, sizeof what, "kblock-%d", fmt);
      const std::vector<float> ref = check_every_path(what, N, K, M, names, npaths, run, x, wd, &ok);
      h = fnv(w.data(), w.size(), fnv(ref.data(), ref.size() * 4, h));
    }
    const char* name = fmt == dw::kKb40 ? "kblock-q4_0" : fmt == dw::kKb41 ? "kblock-q4_1" : fmt == dw::kKb50 ? "kblock-q5_0" : "kblock-q8_0";
    std::printf("%-20s %016llx %s\n", name, (unsigned long long)h, ok ? "ok" : "FAIL");
    failures += !ok;
  }
  return failures;
}


// The AMX tile kernel on emulated tiles for 1-33 and 40 rows (in row blocks of 1, 2 and all groups of 16),
// both formats, through the same check (in a forked child) that verifies the hardware kernel on a CPU with
// AMX; and the check must refuse a kernel whose result differs in one bit.
int check_amx() {
  std::string emu, flipped;
  const bool ok = dw::amx_verify(1, &emu), refused = !dw::amx_verify(2, &flipped);
  if (!ok) std::printf("amx emulated tiles: %s\n", emu.c_str());
  if (!refused) std::printf("amx check: a one-bit difference was not refused\n");
  std::printf("%-20s %s\n", "amx-tiles-emulated", ok && refused ? "ok" : "FAIL");
  const std::string bytes = dw::amx_bytes_check();  // the hardware kernel's prep and split (AVX-512BW only)
  const bool bytes_ok = bytes.empty() || bytes.rfind("skipped", 0) == 0;
  std::printf("%-20s %s\n", "amx-bytes", bytes.empty() ? "ok" : bytes_ok ? bytes.c_str() : ("FAIL: " + bytes).c_str());
  return ok && refused && bytes_ok ? 0 : 1;
}

}  // namespace

int main() {
  const Case cases[] = {
      {"int4-g32-min-K256", 37, 256, 32, 4, true, 8},  {"int4-g32-K192", 21, 192, 32, 4, false, 8},
      {"int4-g32-min-K576", 19, 576, 32, 4, true, 8},  {"int8-g16-K512", 29, 512, 16, 8, false, 8},
      {"int8-g32-min-K224", 23, 224, 32, 8, true, 8},  {"int8-g32-K96", 17, 96, 32, 8, false, 8},
      {"int4-g32-min-f32", 21, 320, 32, 4, true, 32},  {"int8-g16-f32", 19, 256, 16, 8, false, 32},
      {"int8-g32-min-f32", 13, 224, 32, 8, true, 32},  {"bf16-dense", 11, 272, 272, 16, false, 32},
      {"fp32-dense", 9, 160, 160, 32, false, 32},
  };
  std::string amx_why;  // on an AMX CPU: the hardware check (forked child); verified, the path joins the others
  dw::amx_verify(0, &amx_why);
  dw::amx_set_min_rows(dw::kKq4, 1), dw::amx_set_min_rows(dw::kKq6, 1);  // the path's calls of any rows on the tiles
  const char* names[16];
  const int npaths = dw::available_paths(names, 16);
  std::printf("cpu: %s\namx: %s (%s)\npaths:", dw::cpu_features(), dw::amx_state_name(dw::amx_state(nullptr)),
              amx_why.c_str());
  for (int p = 0; p < npaths; ++p) std::printf(" %s", names[p]);
  std::printf("\n");
  int failures = 0;
  for (int p = 0; p < npaths; ++p)  // each path file's IsaOps::name is its core/paths.def name
    if (std::strcmp(dw::path_by_name(names[p])->name, names[p])) {
      std::printf("MISMATCH path %s is named %s by its file\n", names[p], dw::path_by_name(names[p])->name);
      ++failures;
    }
  for (const Case& c : cases) {
    const int64_t M = 13, ng = c.K / c.G, rowbytes = c.K * c.bits / 8;
    std::vector<uint8_t> q(c.N * rowbytes);
    if (c.bits == 32 || c.bits == 16) {  // dense weights: finite values in [-1, 1)
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        const float f = next_f();
        if (c.bits == 32) std::memcpy(q.data() + 4 * i, &f, 4);
        else { uint32_t u; std::memcpy(&u, &f, 4); const uint16_t h = (uint16_t)(u >> 16); std::memcpy(q.data() + 2 * i, &h, 2); }
      }
    } else {
      for (auto& b : q) b = (uint8_t)next_u32();
      if (c.bits == 8) { q[0] = 0x80; q[1] = 0x7F; }  // int8 codes at both ends of their range
    }
    std::vector<float> s(c.N * ng), mn(c.N * ng), x(M * c.K);
    for (auto& v : s) v = c.bits >= 16 ? 1.0f : 0.01f + 0.02f * std::fabs(next_f());
    for (auto& v : mn) v = 0.1f * next_f();
    for (auto& v : x) v = next_f() * 3.0f;
    for (int64_t k = 0; k < 32 && k < c.K; ++k) x[k] = 0.f;  // an all-zero activation block
    x[c.K + 5] = 1e4f;                                        // a block with one huge value
    const std::vector<float> ref = run(&dw::kScalar, c, q, s, mn, x, M);
    bool ok = true;
    for (int p = 0; p < npaths; ++p) {
      const dw::IsaOps* ops = dw::path_by_name(names[p]);
      if (std::memcmp(run(ops, c, q, s, mn, x, M).data(), ref.data(), ref.size() * 4)) {
        std::printf("MISMATCH %s on path %s\n", c.name, names[p]);
        ok = false;
      }
      for (int64_t m : {0, 5, 12}) {  // batch invariance: one row alone gives the same bits
        std::vector<float> xr(x.begin() + m * c.K, x.begin() + (m + 1) * c.K);
        if (std::memcmp(run(ops, c, q, s, mn, xr, 1).data(), ref.data() + m * c.N, c.N * 4)) {
          std::printf("NOT BATCH-INVARIANT %s on path %s (row %lld)\n", c.name, names[p], (long long)m);
          ok = false;
        }
      }
    }
    // a loose check of the reference itself against a double-precision dot product
    double err = 0, mag = 0;
    for (int64_t n = 0; n < c.N; ++n) {
      double d = 0;
      for (int64_t k = 0; k < c.K; ++k) {
        double w;
        if (c.bits == 32) { float f; std::memcpy(&f, q.data() + n * rowbytes + 4 * k, 4); w = f; }
        else if (c.bits == 16) { uint32_t u = (uint32_t)(q[n * rowbytes + 2 * k] | (q[n * rowbytes + 2 * k + 1] << 8)) << 16; float f; std::memcpy(&f, &u, 4); w = f; }
        else if (c.bits == 8) w = (int8_t)q[n * rowbytes + k];
        else { const int64_t j = k % 32, b = n * rowbytes + (k / 32) * 16; w = j < 16 ? (q[b + j] & 15) : (q[b + j - 16] >> 4); }
        w = w * s[n * ng + k / c.G] - (c.minv ? mn[n * ng + k / c.G] : 0.0);
        d += w * x[2 * c.K + k];  // row 2
      }
      err = std::fmax(err, std::fabs(d - ref[2 * c.N + n]));
      mag = std::fmax(mag, std::fabs(d));
    }
    const double tol = c.act_bits == 8 ? 0.02 : 1e-4;  // int8 activations round x to 1/254 of a block's max
    if (!(err <= tol * mag)) { std::printf("INACCURATE %s: max error %g of %g\n", c.name, err, mag); ok = false; }
    std::printf("%-20s %016llx %s\n", c.name, (unsigned long long)fnv(ref.data(), ref.size() * 4), ok ? "ok" : "FAIL");
    failures += !ok;
  }
  // fused layer ops (one implementation, portable: pinned by checksum)
  {
    const int64_t B = 2, T = 3, nh = 4, nkv = 2, hd = 64, cap = 16, D = 96, F = 80;
    std::vector<float> x(B * T * D), w(D), out(B * T * D), gu(B * T * 2 * F), o2(B * T * F);
    for (auto& v : x) v = next_f();
    for (auto& v : w) v = next_f();
    for (auto& v : gu) v = next_f() * 8.0f;
    dw::rms_norm(x.data(), w.data(), B * T, D, 1e-6f, out.data());
    dw::silu_mul(gu.data(), B * T, F, o2.data());
    const int64_t W = (nh + 2 * nkv) * hd;
    std::vector<float> qkv(B * T * W), cs(B * T * hd), sn(B * T * hd), kc(B * nkv * cap * hd), vc(kc.size()),
        att(B * T * nh * hd), p(cap);
    for (auto& v : qkv) v = next_f();
    for (auto& v : cs) v = next_f();
    for (auto& v : sn) v = next_f();
    for (auto& v : kc) v = next_f();
    for (auto& v : vc) v = next_f();
    const int64_t start[2] = {5, 9};
    dw::rope_append(qkv.data(), cs.data(), sn.data(), kc.data(), vc.data(), start, B, T, nh, nkv, hd, cap);
    dw::attend_items(qkv.data(), kc.data(), vc.data(), start, B, T, nh, nkv, hd, cap, att.data(), 0, B * T * nh, p.data());
    float e[64];
    for (int i = 0; i < 64; ++i) e[i] = dw::dw_exp(-20.0f + 0.6f * (float)i);
    double worst = 0;
    for (int i = 0; i < 64; ++i) {
      const double xi = (double)(-20.0f + 0.6f * (float)i);
      worst = std::fmax(worst, std::fabs(e[i] - std::exp(xi)) / std::exp(xi));
    }
    const bool ok = worst < 4e-7;
    std::printf("%-20s %016llx %s\n", "layers", (unsigned long long)fnv(att.data(), att.size() * 4, fnv(o2.data(), o2.size() * 4,
                fnv(out.data(), out.size() * 4, fnv(e, sizeof(e))))), ok ? "ok" : "FAIL (exp inaccurate)");
    failures += !ok;
  }
  {
    const int bad = check_quantize_act(names, npaths) + check_silu_mul(names, npaths) + check_attention(names, npaths);
    std::printf("%-20s %s\n", "per-path layer ops", bad ? "FAIL" : "ok");
    failures += bad;
  }
  failures += check_pool();
  failures += check_kquant(names, npaths);
  failures += check_kblock(names, npaths);
  failures += check_amx();
  {
    const uint64_t h = check_repack();
    std::printf("%-20s %016llx %s\n", "gguf-repack", (unsigned long long)h, h ? "ok" : "FAIL");
    failures += !h;
  }
  std::printf(failures ? "FAILED: %d case(s)\n" : "all paths bit-identical to the reference\n", failures);
  return failures ? 1 : 0;
}
