// The 256-bit x86 path (AVX2 + FMA + F16C; with DW_VNNI, AVX-VNNI's vpdpbusd on ymm), included by
// qmm_avx2.cpp and qmm_avxvnni.cpp after their `#pragma GCC target`. The 16 lanes of the rule (qmm.h)
// live in two ymm registers: lanes 0-7 from code bytes 0-31 of a step, lanes 8-15 from bytes 32-63.
//
// Integer lanes: int4 codes: maddubs(low nibbles, x_a) + maddubs(high nibbles, x_b) in int16 (at most
// 2 * 15 * 127 * 2 = 7620: exact), then madd with ones -> the 4-byte sums. int8 codes: maddubs(|q|,
// sign(x, q)) (at most 2 * 128 * 127 = 32512: exact). With VNNI: dpbusd(0, lo, x_a), then (.., hi, x_b);
// int8 codes as q + 128 (unsigned) from a start of -128 * sum(x) per lane. Same integers either way.
//
// No std:: templates here: inline functions compiled under this file's target must not be shared with
// (and picked by the linker for) code that runs on CPUs without these instructions.
#include <immintrin.h>

#include <cstring>

#include "core/kquant.h"
#include "core/qmm.h"

namespace {

using dw::QmmArgs;

#ifndef DW_MB
#define DW_MB 4
#endif
#ifndef DW_PREFETCH
#define DW_PREFETCH 1
#endif
constexpr int MB_MAX = DW_MB;              // activation rows per pass over a weight row (2 accumulators each)
constexpr int64_t PREFETCH = 2048;     // bytes of codes ahead

#include "arch/x86/x86_act.inc"  // tree16(lo, hi); quantize_act_x86, silu_mul_x86, attend_groups_simd

// 16-lane fma accumulation of o[g] * v[g] into lane g % 16, then tree16 (the affine offset)
inline float offset16(const float* o, const float* v, int64_t ng) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= ng; g += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(o + g), _mm256_loadu_ps(v + g), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(o + g + 8), _mm256_loadu_ps(v + g + 8), hi);
  }
  if (g < ng) {  // masked lanes add fma(0, 0, c) = c
    alignas(32) int32_t m[16];
    for (int l = 0; l < 16; ++l) m[l] = g + l < ng ? -1 : 0;
    const __m256i m0 = _mm256_load_si256((const __m256i*)m), m1 = _mm256_load_si256((const __m256i*)(m + 8));
    lo = _mm256_fmadd_ps(_mm256_maskload_ps(o + g, m0), _mm256_maskload_ps(v + g, m0), lo);
    hi = _mm256_fmadd_ps(_mm256_maskload_ps(o + g + 8, m1), _mm256_maskload_ps(v + g + 8, m1), hi);
  }
  return tree16(lo, hi);
}

// the 8 int32 lane sums of one 32-byte half step for one activation row
template <bool INT4>
inline __m256i lanes8(__m256i lo, __m256i hi, __m256i aw, const int8_t* xa, const int8_t* xb, __m256i start) {
  (void)aw; (void)start;
#if DW_VNNI
  if (INT4) {
    __m256i I = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i*)xa));
    return _mm256_dpbusd_avx_epi32(I, hi, _mm256_loadu_si256((const __m256i*)xb));
  }
  return _mm256_dpbusd_avx_epi32(start, lo /* q ^ 0x80 */, _mm256_loadu_si256((const __m256i*)xa));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (INT4) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xa)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)xb)));
    return _mm256_madd_epi16(p, ones);
  }
  const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)xa), lo /* q */);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
#endif
}

// weight side of one 32-byte half step: the code bytes as the integer multiplies want them
template <bool INT4>
inline void unpack_half(const uint8_t* p, __m256i& lo, __m256i& hi, __m256i& aw) {
  const __m256i W = _mm256_loadu_si256((const __m256i*)p);
  if (INT4) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(W, nib);
    hi = _mm256_and_si256(_mm256_srli_epi16(W, 4), nib);
    aw = lo;
  } else {
#if DW_VNNI
    lo = hi = aw = _mm256_xor_si256(W, _mm256_set1_epi8((char)0x80));  // q + 128, unsigned
#else
    lo = hi = W;
    aw = _mm256_abs_epi8(W);
#endif
  }
}

// output column n, activation rows m0 .. m0 + MB - 1, int8 activations
template <int MB, bool INT4>
inline void column_q8(const QmmArgs& a, int64_t n, int64_t m0) {
  const int64_t K = a.K, ng = K / a.G, rowbytes = K * a.bits / 8, ns = dw::nsteps(K, a.bits), lw = ns * 16;
  const uint8_t* qn = a.q + n * rowbytes;
  const float* sn = a.scale + n * ng;
  const int8_t* xq = a.act.q + m0 * K;
  const float* xl = a.act.lane + m0 * lw;
  const int32_t* xb = a.act.bias + m0 * lw;
  (void)xb;
  const bool four = INT4 || a.G == 16;  // 4 group scales per step (else 2)
  const __m256i i_lo = four ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) : _mm256_setzero_si256();
  const __m256i i_hi = four ? _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3) : _mm256_set1_epi32(1);
  constexpr int64_t STEP = INT4 ? 128 : 64;  // activations per step
  __m256 acc0[MB], acc1[MB];  // lanes 0-7, 8-15
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  const int64_t full = rowbytes / 64;
  for (int64_t c = 0; c < full; ++c) {
#if DW_PREFETCH
    _mm_prefetch((const char*)(qn + 64 * c + PREFETCH), _MM_HINT_T0);
    if ((c & 3) == 0) _mm_prefetch((const char*)(sn + (four ? 4 : 2) * c) + PREFETCH / 4, _MM_HINT_T0);
#endif
    const __m128 s4 = four ? _mm_loadu_ps(sn + 4 * c) : _mm_castpd_ps(_mm_load_sd((const double*)(sn + 2 * c)));
    const __m256 ws0 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), i_lo);
    const __m256 ws1 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), i_hi);
    __m256i lo, hi, aw;
    unpack_half<INT4>(qn + 64 * c, lo, hi, aw);
    for (int i = 0; i < MB; ++i) {
      const int8_t* xr = xq + i * K + STEP * c;
      const __m256i I = lanes8<INT4>(lo, hi, aw, xr, xr + 64, _mm256_loadu_si256((const __m256i*)(xb + i * lw + 16 * c)));
      const __m256 s = _mm256_mul_ps(ws0, _mm256_loadu_ps(xl + i * lw + 16 * c));
      acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), s, acc0[i]);
    }
    unpack_half<INT4>(qn + 64 * c + 32, lo, hi, aw);
    for (int i = 0; i < MB; ++i) {
      const int8_t* xr = xq + i * K + STEP * c + 32;
      const __m256i I = lanes8<INT4>(lo, hi, aw, xr, xr + 64, _mm256_loadu_si256((const __m256i*)(xb + i * lw + 16 * c + 8)));
      const __m256 s = _mm256_mul_ps(ws1, _mm256_loadu_ps(xl + i * lw + 16 * c + 8));
      acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), s, acc1[i]);
    }
  }
  if (full < ns) {  // a 32-byte last step: lanes 0-7 only
    const int64_t c = full, g0 = four ? 4 * c : 2 * c;
    const __m128 s4 = four ? _mm_setr_ps(sn[g0], sn[g0 + 1], 0.f, 0.f) : _mm_set1_ps(sn[g0]);
    const __m256 ws0 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), i_lo);
    __m256i lo, hi, aw;
    unpack_half<INT4>(qn + 64 * c, lo, hi, aw);
    for (int i = 0; i < MB; ++i) {
      const int8_t* xr = xq + i * K + STEP * c;
      const __m256i I = lanes8<INT4>(lo, hi, aw, xr, xr + 32, _mm256_loadu_si256((const __m256i*)(xb + i * lw + 16 * c)));
      const __m256 s = _mm256_mul_ps(ws0, _mm256_loadu_ps(xl + i * lw + 16 * c));
      acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), s, acc0[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float r = tree16(acc0[i], acc1[i]);
    if (a.minv) r = r - offset16(a.minv + n * ng, a.act.gs + (m0 + i) * ng, ng);
    a.out[(m0 + i) * a.N + n] = r;
  }
}

// 16 consecutive code values k .. k + 15 of one row as floats (two halves). k % 16 == 0.
template <int BITS>
inline void codes16(const uint8_t* qn, int64_t k, __m256& w0, __m256& w1) {
  if (BITS == 32) {
    w0 = _mm256_loadu_ps((const float*)qn + k);
    w1 = _mm256_loadu_ps((const float*)qn + k + 8);
  } else if (BITS == 16) {
    const __m256i u = _mm256_loadu_si256((const __m256i*)((const uint16_t*)qn + k));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(u)), 16));
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(u, 1)), 16));
  } else if (BITS == 8) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(qn + k));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  } else {  // int4: k in the low (k % 32 < 16) or high half of its 32-group
    __m128i b = _mm_loadu_si128((const __m128i*)(qn + (k / 32) * 16));
    b = (k % 32) < 16 ? _mm_and_si128(b, _mm_set1_epi8(0x0F)) : _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  }
}

template <int MB, int BITS>
inline void column_f32(const QmmArgs& a, int64_t n, int64_t m0) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  const uint8_t* qn = a.q + n * (K * BITS / 8);
  const float* sn = a.scale + n * ng;
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 part[MB][2];
    for (int i = 0; i < MB; ++i) part[i][0] = part[i][1] = _mm256_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      __m256 w0, w1;
      codes16<BITS>(qn, k, w0, w1);
      for (int i = 0; i < MB; ++i) {
        const float* x = a.x + (m0 + i) * K + k;
        part[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, part[i][0]);
        part[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, part[i][1]);
      }
    }
    const __m256 s = _mm256_set1_ps(sn[g]);
    for (int i = 0; i < MB; ++i) {
      acc[i][0] = _mm256_fmadd_ps(part[i][0], s, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(part[i][1], s, acc[i][1]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float r = tree16(acc[i][0], acc[i][1]);
    if (a.minv) r = r - offset16(a.minv + n * ng, a.xsum + (m0 + i) * ng, ng);
    a.out[(m0 + i) * a.N + n] = r;
  }
}

#define KQ_BITS 256
#include "arch/x86/kquant_x86.inc"  // kq_qmm: the K-quant rule on these vectors
#include "core/tiles.inc"  // for_blocks, qmm_q8, qmm_f32: the tiling every path shares

}  // namespace
