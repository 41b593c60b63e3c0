// The AMX path (amx.h): the tile kernel (kquant_amx.inc) on the hardware and on the emulated tiles, the
// detection (cpuid, XCR0, Linux's permission) and the bit-for-bit check in a forked child.
#include "arch/x86/amx.h"
#include "arch/x86/cpu_features.h"

#include <cmath>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "arch/x86/amx_emu.h"  // before any target pragma: the emulation runs on every CPU
#include "core/kquant.h"
#include "core/qmm.h"
#include "gguf/repack.h"  // kq_pack_rows

#if defined(__linux__)
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

// The hardware half needs a compiler with the AMX intrinsics and an assembler with the tile instructions
// (gcc 11+ / binutils 2.36+, clang 12+); elsewhere it is left out and the path is "not built".
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(DW_NO_AMX) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define DW_AMX_BUILT 1
#include <cpuid.h>
#else
#define DW_AMX_BUILT 0
#endif

namespace {
namespace emu {
#include "arch/x86/kquant_amx.inc"  // kq_amx<T>, plain C++
struct Ops : dw::EmuOps {
  static void prep(int fmt, const uint8_t* blk, uint8_t* B) { amx_prep_ref(fmt, blk, B); }
  static void split(const int8_t* q, const uint8_t* e, int64_t M, int64_t K, int8_t* lo, int8_t* hi) {
    amx_split_ref(q, e, M, K, lo, hi);
  }
};
}  // namespace emu
}  // namespace

#if DW_AMX_BUILT
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")
#include <immintrin.h>
namespace {
namespace hw {

// gcc's tile intrinsics are asm statements that do not tell the compiler which memory they read (tileloadd,
// and ldtilecfg past its first 8 bytes): a compiler barrier before each keeps the stores that fill the
// buffers (the unpacked weights, the configuration) before them. Register numbers must be literals.
inline void barrier() { __asm__ __volatile__("" ::: "memory"); }

struct Tiles {
  static void config(const dw::AmxTileCfg& c) { barrier(); _tile_loadconfig(&c); }
  static void release() { _tile_release(); }
  template <int T>
  static void zero() {
    static_assert(T >= 4 && T <= 7, "accumulators are tmm4..tmm7");
    if constexpr (T == 4) _tile_zero(4);
    else if constexpr (T == 5) _tile_zero(5);
    else if constexpr (T == 6) _tile_zero(6);
    else _tile_zero(7);
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    static_assert(T >= 0 && T <= 3, "B tiles are tmm0, tmm1, A tiles tmm2, tmm3");
    barrier();
    if constexpr (T == 0) _tile_loadd(0, p, stride);
    else if constexpr (T == 1) _tile_loadd(1, p, stride);
    else if constexpr (T == 2) _tile_loadd(2, p, stride);
    else _tile_loadd(3, p, stride);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    static_assert(T >= 4 && T <= 7, "accumulators are tmm4..tmm7");
    if constexpr (T == 4) _tile_stored(4, p, stride);
    else if constexpr (T == 5) _tile_stored(5, p, stride);
    else if constexpr (T == 6) _tile_stored(6, p, stride);
    else _tile_stored(7, p, stride);
    barrier();
  }
  // the (c, a, b) triples kquant_amx.inc uses: tmm0 / tmm1 A, tmm2 / tmm3 B, tmm4..tmm7 C
  template <int C, int A, int B>
  static void dp_su() {
    if constexpr (C == 4 && A == 0 && B == 2) _tile_dpbsud(4, 0, 2);
    else if constexpr (C == 5 && A == 0 && B == 3) _tile_dpbsud(5, 0, 3);
    else if constexpr (C == 6 && A == 1 && B == 2) _tile_dpbsud(6, 1, 2);
    else if constexpr (C == 7 && A == 1 && B == 3) _tile_dpbsud(7, 1, 3);
    else {
      static_assert(C == 5 && A == 1 && B == 2, "unsupported tile triple");
      _tile_dpbsud(5, 1, 2);
    }
  }
  template <int C, int A, int B>
  static void dp_ss() {
    if constexpr (C == 5 && A == 0 && B == 3) _tile_dpbssd(5, 0, 3);
    else {
      static_assert(C == 6 && A == 1 && B == 3, "unsupported tile triple");
      _tile_dpbssd(6, 1, 3);
    }
  }
};

struct Lanes {  // 16 lanes in one zmm register
  using I = __m512i;
  using F = __m512;
  static I iload(const int32_t* p) { return _mm512_loadu_si512((const void*)p); }
  static I u8to32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I i8to32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I set32(int32_t v) { return _mm512_set1_epi32(v); }
  static I izero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I sllv(I a, I n) { return _mm512_sllv_epi32(a, n); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F h2f(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void fstore(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b = fma(a, -b, c)
  static I dpwssd(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
};

// prep and split of kquant_amx.inc on AVX-512BW: the integers of amx_prep_ref / amx_split_ref
struct Bytes {
  using V = __m512i;
  static V ld(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static void st(uint8_t* p, V v) { _mm512_store_si512((void*)p, v); }
  // a sub-block's 16 scales (bytes) as 16-bit lanes, the scale of column n in both halves of 32-bit lane n
  static V pair16(V s32) { return _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16)); }
  static void prep(int fmt, const uint8_t* blk, uint8_t* B) {
    const V m4 = _mm512_set1_epi8(15);
    const int64_t tb = dw::kq_tile_bytes(fmt);  // the super-block 4 ahead, into L1 (a hint: never faults)
    for (int64_t o = 0; o < tb; o += 64) _mm_prefetch((const char*)(blk + 4 * tb + o), _MM_HINT_T0);
    if (fmt == dw::kKq4) {
      for (int c = 0; c < 4; ++c) {
        V slo[2], shi[2];
        for (int h = 0; h < 2; ++h) {  // sub-block 2c + h: scales 0..63 = s_lo + 16 s_hi
          const V s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + dw::KQ4_SC + 16 * (2 * c + h))));
          slo[h] = pair16(_mm512_and_si512(s, _mm512_set1_epi32(15))), shi[h] = pair16(_mm512_srli_epi32(s, 4));
        }
        for (int r = 0; r < 8; ++r) {
          const V g = ld(blk + dw::KQ4_QS + (8 * c + r) * 64);
          const V ql = _mm512_and_si512(g, m4), qh = _mm512_and_si512(_mm512_srli_epi16(g, 4), m4);
          // each 16-bit lane: two codes of one column (<= 15) times its scale part (<= 15): byte products, no carry
          st(B + c * 1024 + r * 64, _mm512_mullo_epi16(ql, slo[0]));
          st(B + 4096 + c * 1024 + r * 64, _mm512_mullo_epi16(ql, shi[0]));
          st(B + c * 1024 + (r + 8) * 64, _mm512_mullo_epi16(qh, slo[1]));
          st(B + 4096 + c * 1024 + (r + 8) * 64, _mm512_mullo_epi16(qh, shi[1]));
        }
      }
      return;
    }
    const V b32 = _mm512_set1_epi8(32), lo8 = _mm512_set1_epi16(0x00FF), fe = _mm512_set1_epi16(0x00FE),
            fe00 = _mm512_set1_epi16((short)0xFE00), m3 = _mm512_set1_epi8(3);
    for (int j = 0; j < 16; ++j) {  // sub-block j = rows 4 (j % 4) .. +3 of chunk j / 4
      const int h = j / 8, part = (j % 8) / 2, s = j % 2, c = j / 4;
      const V sc = pair16(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + dw::KQ6_SC + 16 * j))));
      for (int r4 = 0; r4 < 4; ++r4) {
        const V ql = ld(blk + dw::KQ6_QL + (16 * h + 8 * (part & 1) + 4 * s + r4) * 64);
        const V qh = ld(blk + dw::KQ6_QH + (8 * h + 4 * s + r4) * 64);
        const V lo = part < 2 ? _mm512_and_si512(ql, m4) : _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
        const V hb = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * part), m3);
        const V w = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hb, 4)), b32);  // u - 32 (hb << 4 < 64: no carry)
        const V p0 = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), sc);  // even bytes' products
        const V p1 = _mm512_mullo_epi16(_mm512_srai_epi16(w, 8), sc);                        // odd bytes'
        const int row = 4 * (j % 4) + r4;
        st(B + c * 1024 + row * 64, _mm512_or_si512(_mm512_and_si512(p0, lo8), _mm512_slli_epi16(p1, 8)));
        st(B + 4096 + c * 1024 + row * 64,  // 2 * (P >> 8) of each byte
           _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(p0, 7), fe), _mm512_and_si512(_mm512_slli_epi16(p1, 1), fe00)));
      }
    }
  }
  static void split(const int8_t* q, const uint8_t* e, int64_t M, int64_t K, int8_t* lo, int8_t* hi) {
    const V m7 = _mm512_set1_epi16(127);
    for (int64_t i = 0; i < M * K; i += 32) {  // one block of 32 codes (K % 256 == 0)
      const V v = _mm512_sllv_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + i))), _mm512_set1_epi16(e[i / 32]));
      _mm256_storeu_si256((__m256i*)(lo + i), _mm512_cvtepi16_epi8(_mm512_and_si512(v, m7)));
      _mm256_storeu_si256((__m256i*)(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 7)));
    }
  }
};

struct Ops : Tiles, Lanes, Bytes {};

#include "arch/x86/kquant_amx.inc"  // kq_amx<T> under this target

void run(const dw::KqArgs& a, int64_t t0, int64_t t1) { kq_amx<Ops>(a, t0, t1); }

}  // namespace hw
}  // namespace
#pragma GCC pop_options
#endif  // DW_AMX_BUILT

namespace dw {

namespace {

struct Detected {
  AmxState state;
  std::string reason;
};

#if DW_AMX_BUILT
Detected detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  std::string missing;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    if (!(d & (1u << 24))) missing += " amx-tile";
    if (!(d & (1u << 25))) missing += " amx-int8";
  } else {
    missing = " amx-tile amx-int8";
  }
  // (cpu_has also checks that the OS saves the zmm registers)
  for (const char* f : {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni"})
    if (!cpu_has(f)) missing += std::string(" ") + f;
  if (!missing.empty()) return {AmxState::kNoCpu, "this CPU lacks" + missing + " (cpuid)"};
  if ((cpu_xcr0() & (3ull << 17)) != (3ull << 17))
    return {AmxState::kNoCpu, "the OS has not enabled the AMX tile state (XCR0 bits 17-18)"};
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    const int e = errno;
    // ENOSPC: some thread's alternate signal stack (sigaltstack) is too small for the 8 KB of tile state a
    // signal frame then carries; EINVAL: a kernel before 5.16, which has no such request
    return {AmxState::kNoPermission,
            std::string("Linux refused the AMX tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): ") +
                std::strerror(e) +
                (e == ENOSPC ? "; a thread's sigaltstack is too small for the tile state)"
                             : "; Linux 5.16 or later grants it)")};
  }
  return {AmxState::kUnchecked, "not verified yet"};
#else
  return {AmxState::kNoPermission, "not Linux: this build has no way to ask for the AMX tile state"};
#endif
}
#else
Detected detect() {
#if defined(__x86_64__) || defined(_M_X64)
  return {AmxState::kNotBuilt, "this build has no AMX kernel (the compiler lacks -mamx-tile / -mamx-int8)"};
#else
  return {AmxState::kNotBuilt, "not x86-64"};
#endif
}
#endif

const Detected& detected() {
  static const Detected d = detect();  // thread-safe, once
  return d;
}

std::atomic<int> g_verdict{0};  // 0 unchecked, 1 verified, 2 refused
std::mutex g_mu;
std::string g_reason;  // the verdict's reason (under g_mu)

void record(bool ok, const std::string& reason) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_verdict.load() != 0) return;
  g_reason = reason;
  g_verdict.store(ok ? 1 : 2);
}

using Kernel = void (*)(const KqArgs&, int64_t, int64_t);

void emulated(const KqArgs& a, int64_t t0, int64_t t1) { emu::kq_amx<emu::Ops>(a, t0, t1); }

// The check itself (in the child): random GGUF blocks of both formats, two shapes (one with a partial last
// tile), the kernel on the first M rows for every M = 1..33 (one / two A tiles, two passes) and 40, in row
// blocks of every group, of one and of two (amx_set_block_groups), each against the reference's rows. "" when
// every bit agrees, else the first difference.
// the checks' random numbers (xorshift64*): the same sequence for a seed on every machine
struct Rng {
  uint64_t st;
  uint32_t operator()() {
    st ^= st >> 12, st ^= st << 25, st ^= st >> 27;
    return (uint32_t)((st * 0x2545F4914F6CDD1Dull) >> 32);
  }
};

const char* const kVerifiedReason =
    "the tile kernel gave the reference's bits (Q4_K and Q6_K, 1-33 and 40 rows, in row blocks of 1, 2 and all groups)";

std::string check_kernel(Kernel kernel, bool flip) {
  Rng u32{0x3C6EF372FE94F82Bull};
  const int64_t shapes[2][2] = {{37, 512}, {48, 768}};

  for (int fmt : {kKq4, kKq6}) {
    for (const auto& sh : shapes) {
      const int64_t N = sh[0], K = sh[1], nb = K / QK, gb = kq_gguf_block(fmt), M = 40;
      std::vector<uint8_t> src(N * nb * gb), w(kq_bytes(fmt, N, K));
      for (auto& v : src) v = (uint8_t)u32();
      for (int64_t i = 0; i < N * nb; ++i)
        for (int k = 0; k < (fmt == kKq4 ? 2 : 1); ++k) {
          const uint16_t h = (uint16_t)((u32() & 0x8000) | (u32() % 0x2400));  // finite, |d| < 2^-6
          std::memcpy(&src[i * gb + (fmt == kKq4 ? 2 * k : 208)], &h, 2);
        }
      kq_pack_rows(fmt, src.data(), N, K, w.data(), 0, N);
      std::vector<float> x(M * K);
      for (auto& v : x) v = ((float)(u32() >> 8) / 16777216.0f - 0.5f) * 6.0f;
      for (int64_t m = 0; m < M; m += 3)  // every third row: its blocks of 32 at 2^-(j % 5), refined by shifts 0..3
        for (int64_t k = 0; k < K; ++k) x[m * K + k] = std::ldexp(x[m * K + k], -(int)((k / 32) % 5));
      std::vector<int8_t> q(M * K);
      std::vector<float> d(M * nb), ref(M * N), out(M * N);
      std::vector<int32_t> b16n(M * (K / 16)), b32(M * (K / 32));
      std::vector<uint8_t> e(M * (K / 32));
      std::vector<int32_t> e32(M * (K / 32)), b32p(M * (K / 64));
      act_q8k(x.data(), M, K, q.data(), d.data(), b16n.data(), b32.data(), e.data());
      kq_act_lanes(0, M, K, b32.data(), e.data(), e32.data(), b32p.data());
      KqArgs a{};
      a.M = M, a.K = K, a.N = N, a.fmt = fmt, a.w = w.data();
      a.act = {q.data(), d.data(), b16n.data(), b32.data(), e.data(), e32.data(), b32p.data()};
      a.out = ref.data();
      kq_ref(a, 0, kq_tiles(N));
      for (int64_t run = 0, m = 1; m <= M; m = run % 3 == 2 ? (m == 33 ? M : m + 1) : m, ++run) {
        std::fill(out.begin(), out.end(), -1.0f);
        a.M = m, a.out = out.data();
        amx_set_block_groups(run % 3);  // row blocks of every group, of 1, of 2 (40 rows: 2 + the overlapping last)
        kernel(a, 0, kq_tiles(N));
        amx_set_block_groups(0);
        if (flip && m == 17) out[16 * N + 3] = -out[16 * N + 3] + 1.0f;  // the check must see a difference
        for (int64_t i = 0; i < m * N; ++i)
          if (std::memcmp(&out[i], &ref[i], 4)) {
            char msg[256];
            std::snprintf(msg, sizeof msg, "%s N=%lld K=%lld, %lld rows: row %lld column %lld gives %.9g, the reference %.9g",
                          fmt == kKq4 ? "Q4_K" : "Q6_K", (long long)N, (long long)K, (long long)m, (long long)(i / N),
                          (long long)(i % N), out[i], ref[i]);
            return msg;
          }
      }
    }
  }
  return "";
}

std::string child_check(int mode) {
#if DW_AMX_BUILT
  if (mode == 0 || mode == 3) {
#if defined(__linux__)
    syscall(SYS_arch_prctl, 0x1023L, 18L);  // inherited on fork; asked again all the same (mode 3: may fail)
#endif
    return check_kernel(hw::run, false);
  }
#endif
  if (mode == 0 || mode == 3) return "the hardware kernel is not built";
  return check_kernel(emulated, mode == 2);
}

// the check in a forked child: a fault (SIGILL where the tiles are not really there, SIGSEGV) or a hang
// ends only the child. false with the reason on any difference, fault, time-out or failure to fork.
bool check_in_child(int mode, std::string* reason) {
#if defined(__linux__)
  int fd[2];
  if (pipe(fd) != 0) {
    *reason = std::string("could not run the check: pipe: ") + std::strerror(errno);
    return false;
  }
  const pid_t pid = fork();
  if (pid < 0) {
    *reason = std::string("could not run the check: fork: ") + std::strerror(errno);
    close(fd[0]), close(fd[1]);
    return false;
  }
  if (pid == 0) {  // the child: this thread only, no locks taken but malloc's (fork-safe in glibc)
    close(fd[0]);
    for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE})  // a fault ends the child quietly (no inherited handler,
      signal(sig, SIG_DFL);                           // e.g. Python's faulthandler, prints a crash report)
    std::string msg;
    try {
      msg = child_check(mode);
    } catch (const std::exception& e) {
      msg = std::string("error: ") + e.what();
    }
    for (size_t off = 0; off < msg.size();) {
      const ssize_t n = write(fd[1], msg.data() + off, msg.size() - off);
      if (n <= 0) break;
      off += (size_t)n;
    }
    _exit(msg.empty() ? 0 : 1);
  }
  close(fd[1]);
  std::string msg;
  char buf[512];
  constexpr int kTimeoutMs = 120000;
  int waited = 0;
  bool timed_out = false;
  for (;;) {
    pollfd p{fd[0], POLLIN, 0};
    const int r = poll(&p, 1, 1000);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      if ((waited += 1000) >= kTimeoutMs) {
        timed_out = true;
        kill(pid, SIGKILL);
        break;
      }
      continue;
    }
    const ssize_t n = read(fd[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the child exited (or closed the pipe)
    msg.append(buf, (size_t)n);
  }
  close(fd[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    *reason = "the check did not finish in 120 s (killed)";
    return false;
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    *reason = "the check was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
    return false;
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && msg.empty()) {
    *reason = kVerifiedReason;
    return true;
  }
  *reason = msg.empty() ? "the check exited with status " + std::to_string(WEXITSTATUS(status)) : msg;
  return false;
#else
  if (mode == 0 || mode == 3) {
    *reason = "the check needs fork(): Linux only";
    return false;
  }
  *reason = child_check(mode);  // the emulation cannot fault
  const bool ok = reason->empty();
  if (ok) *reason = kVerifiedReason;
  return ok;
#endif
}

// the path's K-quant call: one row on AVX512-VNNI (its memory-bound kernel), more rows on the tiles; the
// block formats (Q4_0 / Q4_1 / Q5_0 / Q8_0: no tile kernel yet) on AVX512-VNNI at every row count
Kernel g_one_row = nullptr;
std::atomic<int> g_min_rows[2] = {{kAmxMinRowsDefault}, {kAmxMinRowsDefault}};  // Q4_K, Q6_K
int fmt_slot(int fmt) { return fmt == kKq4 ? 0 : fmt == kKq6 ? 1 : -1; }
bool tiles_for(int64_t M, int fmt) {
  const int s = fmt_slot(fmt);
  return s >= 0 && M >= g_min_rows[s].load(std::memory_order_relaxed);
}
#if DW_AMX_BUILT
void kq_path(const KqArgs& a, int64_t t0, int64_t t1) {
  if (tiles_for(a.M, a.fmt)) hw::run(a, t0, t1);
  else g_one_row(a, t0, t1);
}
void act_split(const int8_t* q, const uint8_t* e, int64_t M, int64_t K, int8_t* lo, int8_t* hi) {
  hw::Bytes::split(q, e, M, K, lo, hi);
}
#endif

}  // namespace

const char* amx_state_name(AmxState s) {
  switch (s) {
    case AmxState::kNotBuilt: return "not built";
    case AmxState::kNoCpu: return "unavailable";
    case AmxState::kNoPermission: return "unavailable";
    case AmxState::kUnchecked: return "unchecked";
    case AmxState::kVerified: return "verified";
    case AmxState::kRefused: return "refused";
  }
  return "?";
}

AmxState amx_state(std::string* reason) {
  const Detected& d = detected();
  if (d.state != AmxState::kUnchecked) {
    if (reason) *reason = d.reason;
    return d.state;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const int v = g_verdict.load();
  if (reason) *reason = v ? g_reason : d.reason;
  return v == 1 ? AmxState::kVerified : v == 2 ? AmxState::kRefused : AmxState::kUnchecked;
}

bool amx_usable() { return detected().state == AmxState::kUnchecked && g_verdict.load() == 1; }

bool amx_verify(int mode, std::string* reason) {
  std::string why;
  if (mode == 0) {
    const Detected& d = detected();
    if (d.state != AmxState::kUnchecked) {
      if (reason) *reason = d.reason;
      return false;
    }
    if (g_verdict.load() != 0) return amx_state(reason) == AmxState::kVerified;
    const bool ok = check_in_child(0, &why);
    record(ok, why);
    return amx_state(reason) == AmxState::kVerified;
  }
  const bool ok = check_in_child(mode, &why);
  if (reason) *reason = why;
  return ok;
}

void amx_set_verdict(bool ok, const std::string& reason) {
  if (detected().state == AmxState::kUnchecked) record(ok, reason);
}

void kq_amx_emulated(const KqArgs& a, int64_t t0, int64_t t1) {
  if (kq_is_block(a.fmt)) kq_ref(a, t0, t1);  // the path runs the block formats on AVX512-VNNI, not on tiles
  else emulated(a, t0, t1);
}

std::string amx_bytes_check() {
#if DW_AMX_BUILT
  for (const char* f : {"avx512f", "avx512bw", "avx512dq", "avx512vl"})
    if (!cpu_has(f)) return std::string("skipped: this CPU lacks ") + f;
  Rng rng{0x9E3779B97F4A7C15ull};
  auto u8 = [&] { return (uint8_t)(rng() >> 24); };
  for (int fmt : {kKq4, kKq6}) {
    std::vector<uint8_t> blk(kq_tile_bytes(fmt) * 5);  // the prep reads one super-block (4 more: slack)
    for (int rep = 0; rep < 64; ++rep) {
      for (auto& v : blk) v = u8();
      if (fmt == kKq4)  // the unpacked 6-bit scales and mins
        for (int i = KQ4_SC; i < KQ4_D; ++i) blk[i] &= 63;
      alignas(64) uint8_t ref[8192], got[8192];
      emu::amx_prep_ref(fmt, blk.data(), ref);
      hw::Bytes::prep(fmt, blk.data(), got);
      for (int i = 0; i < 8192; ++i)
        if (ref[i] != got[i])
          return std::string(fmt == kKq4 ? "Q4_K" : "Q6_K") + " prep: byte " + std::to_string(i) + " is " +
                 std::to_string(got[i]) + ", the reference's " + std::to_string(ref[i]);
    }
  }
  const int64_t M = 3, K = 512;
  std::vector<int8_t> q(M * K), lo(M * K), hi(M * K), lr(M * K), hr(M * K);
  std::vector<uint8_t> e(M * K / 32);
  for (auto& v : q) v = (int8_t)u8();
  for (auto& v : q) v = v == -128 ? 127 : v;  // act_q8k's codes: |q| <= 127
  for (auto& v : e) v = u8() & 3;
  emu::amx_split_ref(q.data(), e.data(), M, K, lr.data(), hr.data());
  hw::Bytes::split(q.data(), e.data(), M, K, lo.data(), hi.data());
  if (lo != lr || hi != hr) return "split: the activations' bytes differ from the reference's";
  return "";
#else
  return "skipped: the hardware kernel is not built";
#endif
}

bool kq_amx_hardware(const KqArgs& a, int64_t t0, int64_t t1) {
#if DW_AMX_BUILT
  if (!amx_usable()) return false;
  if (kq_is_block(a.fmt)) avx512vnni_ops()->qmm_k(a, t0, t1);
  else hw::run(a, t0, t1);
  return true;
#else
  (void)a, (void)t0, (void)t1;
  return false;
#endif
}

std::atomic<int64_t> g_block_groups{0};  // 0: from kAmxBlockBytes
int64_t amx_block_groups(int64_t K) {
  const int64_t fixed = g_block_groups.load(std::memory_order_relaxed);
  const int64_t g = fixed > 0 ? fixed : kAmxBlockBytes / (2 * K * 16);
  return g < 1 ? 1 : g;
}
void amx_set_block_groups(int64_t groups) { g_block_groups.store(groups > 0 ? groups : 0); }

int amx_min_rows(int fmt) {
  const int s = fmt_slot(fmt);
  return s < 0 ? 0 : g_min_rows[s].load();
}
bool amx_set_min_rows(int fmt, int rows) {
  const int s = fmt_slot(fmt);
  if (s < 0 || rows < 1) return false;
  g_min_rows[s].store(rows);
  return true;
}

const IsaOps* amx_ops() {
#if DW_AMX_BUILT
  static const IsaOps* ops = []() -> const IsaOps* {
    const IsaOps* vnni = avx512vnni_ops();
    if (!vnni) return nullptr;
    static IsaOps o = *vnni;  // every op but the K-quant rule's is AVX512-VNNI's
    o.name = "amx";
    g_one_row = vnni->qmm_k;
    o.qmm_k = kq_path;
    o.tiles_for = tiles_for;
    o.act_split = act_split;
    return &o;
  }();
  return ops;
#else
  return nullptr;
#endif
}

}  // namespace dw
