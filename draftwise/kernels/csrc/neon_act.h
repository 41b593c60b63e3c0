// Per-call work around the matmul on ARM NEON: int8 quantization of the activations, the fused
// silu(gate) * up, and the pieces of decode attention (head_dot, exp_sum, head_values; the scaffold is
// attend.h), included inside neon.h's anonymous namespace (after its tree16). The same bits as the scalar
// references (qmm_ref.cpp quantize_act; layers.cpp silu_mul, dw_exp, attend_items): the same float
// operations in the same order, one element per lane (vmulq + vaddq where the reference multiplies and
// adds: never vfmaq), exact integer sums. No headers (and no std::) inside.

// round to nearest even for |v| < 2^22, as dw::round_even
inline float32x4_t round_even4(float32x4_t v) {
  const float32x4_t m = vdupq_n_f32(dw::kRoundMagic);
  return vsubq_f32(vaddq_f32(v, m), m);
}

// dw::quantize_act (qmm.h rule, step 1), 32 activations per block in eight 4-lane registers
void quantize_act_neon(const float* xp, int64_t M, int64_t K, int64_t G, int64_t bits, int8_t* q, float* lane,
                       int32_t* bias, float* gs) {
  const bool int4 = bits == 4;
  const int64_t nb = K / dw::ACT_BLOCK, ng = K / G, ns = dw::nsteps(K, bits), rowbytes = K * bits / 8;
  for (int64_t i = 0; i < M; ++i) {
    const float* x = xp + i * K;
    int8_t* qi = q + i * K;
    float* li = lane + i * ns * 16;
    int32_t* bi = bias + i * ns * 16;
    float* gi = gs + i * ng;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * dw::ACT_BLOCK;
      float32x4_t v[8];
      // amax, NaN ignored as the reference does: vmaxnm returns the number when one operand is NaN
      float32x4_t m = vdupq_n_f32(0.f);
      for (int j = 0; j < 8; ++j) v[j] = vld1q_f32(xb + 4 * j), m = vmaxnmq_f32(vabsq_f32(v[j]), m);
      const float amax = vmaxnmvq_f32(m);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const float32x4_t vinv = vdupq_n_f32(inv);
      int32x4_t c[8];
      for (int j = 0; j < 8; ++j) c[j] = vcvtq_s32_f32(round_even4(vmulq_f32(v[j], vinv)));
      // |code| <= 127: the saturating narrows are exact
      const int8x16_t lo = vcombine_s8(vqmovn_s16(vcombine_s16(vqmovn_s32(c[0]), vqmovn_s32(c[1]))),
                                       vqmovn_s16(vcombine_s16(vqmovn_s32(c[2]), vqmovn_s32(c[3]))));
      const int8x16_t hi = vcombine_s8(vqmovn_s16(vcombine_s16(vqmovn_s32(c[4]), vqmovn_s32(c[5]))),
                                       vqmovn_s16(vcombine_s16(vqmovn_s32(c[6]), vqmovn_s32(c[7]))));
      vst1q_s8(qi + dw::act_position(b * dw::ACT_BLOCK, K, int4), lo);
      vst1q_s8(qi + dw::act_position(b * dw::ACT_BLOCK + 16, K, int4), hi);
      const float s = amax / 127.f;
      if (int4) {
        vst1q_f32(li + 16 * (b / 4) + 4 * (b % 4), vdupq_n_f32(s));
      } else {
        float* l8 = li + 16 * (b / 2) + 8 * (b % 2);
        vst1q_f32(l8, vdupq_n_f32(s)), vst1q_f32(l8 + 4, vdupq_n_f32(s));
        // -128 * the sum of each lane's 4 codes: lanes 8 (b % 2) .. + 7 of step b / 2
        int32_t* b8 = bi + 16 * (b / 2) + 8 * (b % 2);
        const int32x4_t s0 = vpaddq_s32(c[0], c[1]), s1 = vpaddq_s32(c[2], c[3]);  // pairs
        const int32x4_t s2 = vpaddq_s32(c[4], c[5]), s3 = vpaddq_s32(c[6], c[7]);
        const int32x4_t m128 = vdupq_n_s32(-128);
        vst1q_s32(b8, vmulq_s32(vpaddq_s32(s0, s1), m128)), vst1q_s32(b8 + 4, vmulq_s32(vpaddq_s32(s2, s3), m128));
      }
      const int32_t sum_lo = vaddvq_s32(vaddq_s32(vaddq_s32(c[0], c[1]), vaddq_s32(c[2], c[3])));
      const int32_t sum_hi = vaddvq_s32(vaddq_s32(vaddq_s32(c[4], c[5]), vaddq_s32(c[6], c[7])));
      if (G == 32) {
        gi[b] = s * (float)(sum_lo + sum_hi);
      } else {  // G == 16: two groups per block
        gi[2 * b] = s * (float)sum_lo;
        gi[2 * b + 1] = s * (float)sum_hi;
      }
    }
    if (int4) __builtin_memset(bi, 0, ns * 16 * sizeof(int32_t));  // only int8 codes read the bias
    if (rowbytes % 64) {  // unused lanes of a 32-byte tail step
      for (int d = 8; d < 16; ++d) li[16 * (ns - 1) + d] = 0.f, bi[16 * (ns - 1) + d] = 0;
    }
  }
}

// dw::dw_exp on 4 lanes: the same Cephes polynomial, the same operations (no FMA), the same special cases
inline float32x4_t exp4(float32x4_t x) {
  const float32x4_t n = round_even4(vmulq_f32(x, vdupq_n_f32(dw::kExpLog2e)));
  float32x4_t r = vsubq_f32(x, vmulq_f32(n, vdupq_n_f32(dw::kExpLn2Hi)));
  r = vaddq_f32(r, vmulq_f32(n, vdupq_n_f32(dw::kExpLn2Lo)));
  float32x4_t p = vdupq_n_f32(dw::kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(dw::kExpPoly[i]));
  const float32x4_t y = vaddq_f32(vaddq_f32(vmulq_f32(p, vmulq_f32(r, r)), r), vdupq_n_f32(1.0f));
  // y * 2^n; n = 128 (x just below the overflow bound) scales by 2^127 and then 2
  const int32x4_t ni = vcvtq_s32_f32(n);
  const uint32x4_t big = vcgtq_s32(ni, vdupq_n_s32(127));
  const int32x4_t e = vminq_s32(ni, vdupq_n_s32(127));
  const float32x4_t scale = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(e, vdupq_n_s32(127)), 23));
  const float32x4_t ys = vmulq_f32(y, scale);
  float32x4_t res = vbslq_f32(big, vmulq_f32(ys, vdupq_n_f32(2.0f)), ys);
  res = vbslq_f32(vcltq_f32(x, vdupq_n_f32(dw::kExpLo)), vdupq_n_f32(0.f), res);
  res = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(dw::kExpHi)), vdupq_n_f32(__builtin_inff()), res);
  return vbslq_f32(vceqq_f32(x, x), res, x);  // NaN in, NaN out
}

// dw::silu_mul: out = gate / (1 + exp(-gate)) * up
void silu_mul_neon(const float* gu, int64_t M, int64_t F, float* out) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* a = gu + m * 2 * F;
    const float* b = a + F;
    float* o = out + m * F;
    int64_t j = 0;
    for (; j + 4 <= F; j += 4) {
      const float32x4_t g = vld1q_f32(a + j);
      const float32x4_t den = vaddq_f32(one, exp4(vnegq_f32(g)));
      vst1q_f32(o + j, vmulq_f32(vdivq_f32(g, den), vld1q_f32(b + j)));
    }
    for (; j < F; ++j) o[j] = a[j] / (1.0f + dw::dw_exp(-a[j])) * b[j];  // the reference's tail
  }
}

// o[j0 .. j0 + 32) += keys s0 .. s1 - 1 of the weighted value sum (attend.h head_values)
inline void values_chunk32(const float* p, float inv, const float* V, int64_t L, const int64_t* seen, int64_t s0,
                           int64_t s1, int64_t hd, int64_t j0, float* o) {
  float32x4_t a[8];
  for (int l = 0; l < 8; ++l) a[l] = s0 ? vld1q_f32(o + j0 + 4 * l) : vdupq_n_f32(0.f);
  for (int64_t s = s0; s < s1; ++s) {
    const float32x4_t w = vdupq_n_f32(p[s] * inv);
    const float* v = V + (s < L || !seen ? s : L + seen[s - L]) * hd + j0;
    for (int l = 0; l < 8; ++l) a[l] = vaddq_f32(a[l], vmulq_f32(w, vld1q_f32(v + 4 * l)));
  }
  for (int l = 0; l < 8; ++l) vst1q_f32(o + j0 + 4 * l, a[l]);
}

inline void head_values(const float* p, float inv, const float* V, int64_t L, const int64_t* seen, int64_t s0,
                        int64_t s1, int64_t hd, float* o) {
  for (int64_t j0 = 0; j0 < hd; j0 += 32) values_chunk32(p, inv, V, L, seen, s0, s1, hd, j0, o);
}

inline float head_dot(const float* q, const float* k, int64_t hd) {  // layers.cpp dot16, four 4-lane quarters
  float32x4_t acc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
  for (int64_t j = 0; j < hd; j += 16)
    for (int l = 0; l < 4; ++l) acc[l] = vaddq_f32(acc[l], vmulq_f32(vld1q_f32(q + j + 4 * l), vld1q_f32(k + j + 4 * l)));
  return tree16(acc);
}

inline float exp_sum(float* p, int64_t S, float mx) {
  float32x4_t sums[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
  const float32x4_t vmx = vdupq_n_f32(mx);
  int64_t s = 0;
  for (; s + 16 <= S; s += 16)
    for (int l = 0; l < 4; ++l) {
      const float32x4_t e = exp4(vsubq_f32(vld1q_f32(p + s + 4 * l), vmx));
      vst1q_f32(p + s + 4 * l, e);
      sums[l] = vaddq_f32(sums[l], e);
    }
  float sum[16];
  for (int l = 0; l < 4; ++l) vst1q_f32(sum + 4 * l, sums[l]);
  for (; s < S; ++s) {
    p[s] = dw::dw_exp(p[s] - mx);
    sum[s % 16] = sum[s % 16] + p[s];
  }
  return dw::tree16(sum);
}

#include "attend.h"  // attend_groups_simd
