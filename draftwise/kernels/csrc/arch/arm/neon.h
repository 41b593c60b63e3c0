// The ARM NEON path (AArch64; with DW_DOT, the dot-product extension's vdotq_s32: Apple M1+, Graviton 2+,
// Cortex-A76+), included by qmm_neon.cpp and qmm_neondot.cpp. The 16 lanes of the rule (qmm.h) are four
// int32x4 / float32x4 registers: lane d holds code bytes 4d..4d+3 of a step. Without dotprod each lane
// sum is built from vmull_s8 products (exact in int16) widened by pairwise adds. No std:: templates here.
#include <arm_neon.h>

#include <cstring>

#include "core/kquant.h"
#include "core/qmm.h"

namespace {

using dw::QmmArgs;

constexpr int MB_MAX = 4;

inline float tree16(const float32x4_t* a) {
  const float32x4_t b0 = vaddq_f32(a[0], a[2]), b1 = vaddq_f32(a[1], a[3]);  // b[i] = a[i] + a[i + 8]
  const float32x4_t c = vaddq_f32(b0, b1);                                     // c[i] = b[i] + b[i + 4]
  const float32x2_t d = vadd_f32(vget_low_f32(c), vget_high_f32(c));           // d[i] = c[i] + c[i + 2]
  return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}

inline float offset16(const float* o, const float* v, int64_t ng) {
  float32x4_t c[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
  int64_t g = 0;
  for (; g + 16 <= ng; g += 16)
    for (int j = 0; j < 4; ++j) c[j] = vfmaq_f32(c[j], vld1q_f32(o + g + 4 * j), vld1q_f32(v + g + 4 * j));
  if (g < ng) {
    float ot[16] = {0}, vt[16] = {0};
    for (int64_t l = 0; g + l < ng; ++l) { ot[l] = o[g + l]; vt[l] = v[g + l]; }
    for (int j = 0; j < 4; ++j) c[j] = vfmaq_f32(c[j], vld1q_f32(ot + 4 * j), vld1q_f32(vt + 4 * j));
  }
  return tree16(c);
}

// 4 lanes (16 code bytes) of one row: sum over each 4 bytes of w * x (w, x as s8), added to I
inline int32x4_t dot4(int32x4_t I, int8x16_t w, int8x16_t x) {
#if DW_DOT
  return vdotq_s32(I, w, x);
#else
  const int16x8_t p0 = vmull_s8(vget_low_s8(w), vget_low_s8(x)), p1 = vmull_high_s8(w, x);
  return vaddq_s32(I, vpaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)));
#endif
}

template <int MB, bool INT4>
inline void column_q8(const QmmArgs& a, int64_t n, int64_t m0) {
  const int64_t K = a.K, ng = K / a.G, rowbytes = K * a.bits / 8, ns = dw::nsteps(K, a.bits), lw = ns * 16;
  const uint8_t* qn = a.q + n * rowbytes;
  const float* sn = a.scale + n * ng;
  const int8_t* xq = a.act.q + m0 * K;
  const float* xl = a.act.lane + m0 * lw;
  const bool four = INT4 || a.G == 16;
  const uint8x16_t nib = vdupq_n_u8(0x0F);
  float32x4_t acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = vdupq_n_f32(0.f);
  const int64_t full = rowbytes / 64;
  for (int64_t c = 0; c < ns; ++c) {
    const int nq = c == full ? 2 : 4;  // 16-byte quarters in this step (a 32-byte tail has 2)
    const int64_t g0 = four ? 4 * c : 2 * c;
    const int64_t step = INT4 ? 128 : 64, half = nq * 16;
    for (int j = 0; j < nq; ++j) {
      const uint8x16_t W = vld1q_u8(qn + 64 * c + 16 * j);
      int8x16_t lo, hi;
      if (INT4) {
        lo = vreinterpretq_s8_u8(vandq_u8(W, nib));
        hi = vreinterpretq_s8_u8(vshrq_n_u8(W, 4));
      } else {
        lo = hi = vreinterpretq_s8_u8(W);
      }
      const float32x4_t ws = vdupq_n_f32(sn[four ? g0 + j : g0 + j / 2]);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xr = xq + i * K + step * c + 16 * j;
        int32x4_t I = dot4(vdupq_n_s32(0), lo, vld1q_s8(xr));
        if (INT4) I = dot4(I, hi, vld1q_s8(xr + half));
        const float32x4_t s = vmulq_f32(ws, vld1q_f32(xl + i * lw + 16 * c + 4 * j));
        acc[i][j] = vfmaq_f32(acc[i][j], vcvtq_f32_s32(I), s);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    float r = tree16(acc[i]);
    if (a.minv) r = r - offset16(a.minv + n * ng, a.act.gs + (m0 + i) * ng, ng);
    a.out[(m0 + i) * a.N + n] = r;
  }
}

template <int BITS>
inline void codes16(const uint8_t* qn, int64_t k, float32x4_t* w) {
  if (BITS == 32) {
    for (int j = 0; j < 4; ++j) w[j] = vld1q_f32((const float*)qn + k + 4 * j);
  } else if (BITS == 16) {
    for (int j = 0; j < 4; ++j)
      w[j] = vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16((const uint16_t*)qn + k + 4 * j)), 16));
  } else {
    int8x16_t b;
    if (BITS == 8) {
      b = vld1q_s8((const int8_t*)qn + k);
    } else {
      const uint8x16_t u = vld1q_u8(qn + (k / 32) * 16);
      b = vreinterpretq_s8_u8((k % 32) < 16 ? vandq_u8(u, vdupq_n_u8(0x0F)) : vshrq_n_u8(u, 4));
    }
    const int16x8_t h0 = vmovl_s8(vget_low_s8(b)), h1 = vmovl_high_s8(b);
    w[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h0)));
    w[1] = vcvtq_f32_s32(vmovl_high_s16(h0));
    w[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h1)));
    w[3] = vcvtq_f32_s32(vmovl_high_s16(h1));
  }
}

template <int MB, int BITS>
inline void column_f32(const QmmArgs& a, int64_t n, int64_t m0) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  const uint8_t* qn = a.q + n * (K * BITS / 8);
  const float* sn = a.scale + n * ng;
  float32x4_t acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < ng; ++g) {
    float32x4_t part[MB][4];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < 4; ++j) part[i][j] = vdupq_n_f32(0.f);
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      float32x4_t w[4];
      codes16<BITS>(qn, k, w);
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < 4; ++j) part[i][j] = vfmaq_f32(part[i][j], vld1q_f32(a.x + (m0 + i) * K + k + 4 * j), w[j]);
    }
    const float32x4_t s = vdupq_n_f32(sn[g]);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = vfmaq_f32(acc[i][j], part[i][j], s);
  }
  for (int i = 0; i < MB; ++i) {
    float r = tree16(acc[i]);
    if (a.minv) r = r - offset16(a.minv + n * ng, a.xsum + (m0 + i) * ng, ng);
    a.out[(m0 + i) * a.N + n] = r;
  }
}

#include "arch/arm/neon_act.inc"  // quantize_act_neon, silu_mul_neon, attend_groups_simd
#include "arch/arm/kquant_neon.inc"  // kq_qmm: the K-quant rule on these vectors
#include "core/tiles.inc"  // for_blocks, qmm_q8, qmm_f32: the tiling every path shares

}  // namespace
