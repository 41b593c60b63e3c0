// The 512-bit x86 path (AVX-512 F/BW/DQ/VL; with DW_VNNI, AVX512-VNNI's vpdpbusd), included by
// qmm_avx512.cpp and qmm_avx512vnni.cpp after their `#pragma GCC target`. The 16 lanes of the rule
// (qmm.h) are one zmm register. Integer lanes as in x86_256.h; int8 codes without VNNI take |q| and move
// the sign onto x with a byte mask (AVX-512 has no vpsignb). No std:: templates here (see x86_256.h).
#include <immintrin.h>

#include <cstring>

#include "core/kquant.h"
#include "core/qmm.h"

namespace {

using dw::QmmArgs;

constexpr int MB_MAX = 8;           // activation rows per pass over a weight row
constexpr int64_t PREFETCH = 2048;  // bytes of codes ahead (measured on Sapphire Rapids: 512 → 22.6, 2048 → 26 GB/s)

inline float tree16(__m512 a) {
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

inline float offset16(const float* o, const float* v, int64_t ng) {
  __m512 c = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= ng; g += 16) c = _mm512_fmadd_ps(_mm512_loadu_ps(o + g), _mm512_loadu_ps(v + g), c);
  if (g < ng) {
    const __mmask16 m = (__mmask16)((1u << (ng - g)) - 1);
    c = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, o + g), _mm512_maskz_loadu_ps(m, v + g), c);
  }
  return tree16(c);
}

template <int MB, bool INT4>
inline void column_q8(const QmmArgs& a, int64_t n, int64_t m0) {
  const int64_t K = a.K, ng = K / a.G, rowbytes = K * a.bits / 8, ns = dw::nsteps(K, a.bits), lw = ns * 16;
  const uint8_t* qn = a.q + n * rowbytes;
  const float* sn = a.scale + n * ng;
  const int8_t* xq = a.act.q + m0 * K;
  const float* xl = a.act.lane + m0 * lw;
  const int32_t* xb = a.act.bias + m0 * lw;
  (void)xb;
  const bool four = INT4 || a.G == 16;
  const __m512i sidx = four ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i nib = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full = rowbytes / 64;
  for (int64_t c = 0; c < ns; ++c) {
    const bool tail = c == full;
    const __mmask64 bm = tail ? (__mmask64)0xFFFFFFFFull : ~(__mmask64)0;
    _mm_prefetch((const char*)(qn + 64 * c + PREFETCH), _MM_HINT_T0);
    if ((c & 3) == 0) _mm_prefetch((const char*)(sn + (four ? 4 : 2) * c) + PREFETCH / 4, _MM_HINT_T0);
    const int64_t g0 = four ? 4 * c : 2 * c;
    const int nsc = tail ? (four ? 2 : 1) : (four ? 4 : 2);
    const __m128 s4 = _mm_maskz_loadu_ps((__mmask8)((1u << nsc) - 1), sn + g0);
    const __m512 ws = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(s4));
    const __m512i W = _mm512_maskz_loadu_epi8(bm, qn + 64 * c);
    __m512i lo, hi, aw = zero;
    __mmask64 neg = 0;
    (void)neg;
    if (INT4) {
      lo = _mm512_and_si512(W, nib);
      hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), nib);
    } else {
#if DW_VNNI
      lo = _mm512_xor_si512(W, _mm512_set1_epi8((char)0x80));
#else
      lo = W;
      aw = _mm512_abs_epi8(W);
      neg = _mm512_movepi8_mask(W);
#endif
      hi = lo;
    }
    (void)aw;
    const int64_t step = INT4 ? 128 : 64, half = tail ? 32 : 64;
    for (int i = 0; i < MB; ++i) {
      const int8_t* xr = xq + i * K + step * c;
      const __m512i xa = _mm512_maskz_loadu_epi8(bm, xr);
      __m512i I;
#if DW_VNNI
      if (INT4) {
        I = _mm512_dpbusd_epi32(zero, lo, xa);
        I = _mm512_dpbusd_epi32(I, hi, _mm512_maskz_loadu_epi8(bm, xr + half));
      } else {
        I = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void*)(xb + i * lw + 16 * c)), lo, xa);
      }
#else
      const __m512i ones = _mm512_set1_epi16(1);
      if (INT4) {
        const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xa),
                                           _mm512_maddubs_epi16(hi, _mm512_maskz_loadu_epi8(bm, xr + half)));
        I = _mm512_madd_epi16(p, ones);
      } else {
        const __m512i sx = _mm512_mask_sub_epi8(xa, neg, zero, xa);
        I = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), ones);
      }
#endif
      const __m512 s = _mm512_mul_ps(ws, _mm512_loadu_ps(xl + i * lw + 16 * c));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), s, acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float r = tree16(acc[i]);
    if (a.minv) r = r - offset16(a.minv + n * ng, a.act.gs + (m0 + i) * ng, ng);
    a.out[(m0 + i) * a.N + n] = r;
  }
}

template <int BITS>
inline __m512 codes16(const uint8_t* qn, int64_t k) {
  if (BITS == 32) return _mm512_loadu_ps((const float*)qn + k);
  if (BITS == 16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)qn + k))), 16));
  if (BITS == 8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qn + k))));
  __m128i b = _mm_loadu_si128((const __m128i*)(qn + (k / 32) * 16));
  b = (k % 32) < 16 ? _mm_and_si128(b, _mm_set1_epi8(0x0F)) : _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

template <int MB, int BITS>
inline void column_f32(const QmmArgs& a, int64_t n, int64_t m0) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  const uint8_t* qn = a.q + n * (K * BITS / 8);
  const float* sn = a.scale + n * ng;
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 part[MB];
    for (int i = 0; i < MB; ++i) part[i] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m512 w = codes16<BITS>(qn, k);
      for (int i = 0; i < MB; ++i) part[i] = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + (m0 + i) * K + k), w, part[i]);
    }
    const __m512 s = _mm512_set1_ps(sn[g]);
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(part[i], s, acc[i]);
  }
  for (int i = 0; i < MB; ++i) {
    float r = tree16(acc[i]);
    if (a.minv) r = r - offset16(a.minv + n * ng, a.xsum + (m0 + i) * ng, ng);
    a.out[(m0 + i) * a.N + n] = r;
  }
}

#define DW_ACT_512 1  // attention in zmm tiles (the same bits)
#include "arch/x86/x86_act.inc"  // quantize_act_x86, silu_mul_x86 (256-bit), attend_groups_simd
#define KQ_BITS 512
#include "arch/x86/kquant_x86.inc"  // kq_qmm: the K-quant rule on these vectors
#include "core/tiles.inc"  // for_blocks, qmm_q8, qmm_f32: the tiling every path shares

}  // namespace
