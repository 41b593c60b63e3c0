// The scalar reference path: the rule of qmm.h written out in plain C++, one lane at a time. Every SIMD
// path must produce exactly these bits (tests/test_kernels.py and selftest.cpp compare them). Also the
// activation quantization and group sums shared by all paths (plain C++, so the same on every CPU).
#include "core/qmm.h"
#include "core/kquant.h"

#include <cmath>
#include <cstring>

namespace dw {

namespace {

inline float code_f32(const uint8_t* qn, int64_t k, int64_t bits) {  // de-quantized code value (exact)
  switch (bits) {
    case 32: { float f; std::memcpy(&f, qn + 4 * k, 4); return f; }
    case 16: { uint32_t u = (uint32_t)(qn[2 * k] | (qn[2 * k + 1] << 8)) << 16; float f; std::memcpy(&f, &u, 4); return f; }
    case 8: return (float)(int8_t)qn[k];
    default: {  // int4: per 32-group, byte j = q[j] | q[j + 16] << 4
      const int64_t j = k % 32, b = (k / 32) * 16;
      return (float)(j < 16 ? (qn[b + j] & 15) : (qn[b + j - 16] >> 4));
    }
  }
}

// affine offset of one output: tree16 of c[g % 16] = fma(minv[g], gs[g], c[g % 16])
inline float offset(const float* mn, const float* gs, int64_t ng) {
  float c[16] = {0};
  for (int64_t g = 0; g < ng; ++g) c[g % 16] = std::fma(mn[g], gs[g], c[g % 16]);
  return tree16(c);
}

void ref_q8(const QmmArgs& a, int64_t n0, int64_t n1) {
  const bool int4 = a.bits == 4;
  const int64_t K = a.K, ng = K / a.G, rowbytes = K * a.bits / 8, ns = nsteps(K, a.bits);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = a.q + n * rowbytes;
    const float* sn = a.scale + n * ng;
    for (int64_t m = 0; m < a.M; ++m) {
      const int8_t* xq = a.act.q + m * K;
      const float* xl = a.act.lane + m * ns * 16;
      float acc[16] = {0};
      for (int64_t c = 0; c < ns; ++c) {
        const int64_t bytes = rowbytes - 64 * c < 64 ? rowbytes - 64 * c : 64;
        for (int d = 0; d < bytes / 4; ++d) {
          int32_t I = 0;
          for (int64_t b = 4 * d; b < 4 * d + 4; ++b) {
            const uint8_t byte = qn[64 * c + b];
            if (int4) I += (byte & 15) * xq[128 * c + b] + (byte >> 4) * xq[128 * c + bytes + b];
            else I += (int8_t)byte * xq[64 * c + b];
          }
          const int64_t g = int4 ? 4 * c + d / 4 : (64 * c + 4 * d) / a.G;
          const float s = sn[g] * xl[16 * c + d];
          acc[d] = std::fma((float)I, s, acc[d]);
        }
      }
      float r = tree16(acc);
      if (a.minv) r = r - offset(a.minv + n * ng, a.act.gs + m * ng, ng);
      a.out[m * a.N + n] = r;
    }
  }
}

void ref_f32(const QmmArgs& a, int64_t n0, int64_t n1) {
  const int64_t K = a.K, G = a.G, ng = K / G, rowbytes = K * a.bits / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = a.q + n * rowbytes;
    const float* sn = a.scale + n * ng;
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * K;
      float acc[16] = {0};
      for (int64_t g = 0; g < ng; ++g) {
        float part[16] = {0};
        for (int64_t k = g * G; k < (g + 1) * G; ++k) part[k % 16] = std::fma(x[k], code_f32(qn, k, a.bits), part[k % 16]);
        for (int l = 0; l < 16; ++l) acc[l] = std::fma(part[l], sn[g], acc[l]);
      }
      float r = tree16(acc);
      if (a.minv) r = r - offset(a.minv + n * ng, a.xsum + m * ng, ng);
      a.out[m * a.N + n] = r;
    }
  }
}

}  // namespace

const IsaOps kScalar = {"scalar", ref_q8, ref_f32, quantize_act, silu_mul_span, attend_groups, kq_ref, act_q8k, act_q8b};
const IsaOps* scalar_ops() { return &kScalar; }

float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400)) man <<= 1, --exp;
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

ActQ8Sizes act_sizes(int64_t M, int64_t K, int64_t G, int64_t bits) {
  return {M * K, M * nsteps(K, bits) * 16, M * (K / G)};
}

void quantize_act(const float* xp, int64_t M, int64_t K, int64_t G, int64_t bits, int8_t* q, float* lane,
                  int32_t* bias, float* gs) {
  const bool int4 = bits == 4;
  const int64_t nb = K / ACT_BLOCK, ng = K / G, ns = nsteps(K, bits), rowbytes = K * bits / 8;
  for (int64_t i = 0; i < M; ++i) {
    const float* x = xp + i * K;
    int8_t* qi = q + i * K;
    // block scales and codes
    float* li = lane + i * ns * 16;
    int32_t* bi = bias + i * ns * 16;
    float* gi = gs + i * ng;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int64_t k = b * ACT_BLOCK; k < (b + 1) * ACT_BLOCK; ++k) amax = std::fabs(x[k]) > amax ? std::fabs(x[k]) : amax;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = qi + act_position(b * ACT_BLOCK, K, int4);  // a block's 16-value halves are contiguous
      int8_t* dst_hi = qi + act_position(b * ACT_BLOCK + 16, K, int4);
      for (int64_t j = 0; j < ACT_BLOCK; ++j) {
        const int8_t v = (int8_t)round_even(x[b * ACT_BLOCK + j] * inv);
        if (j < 16) dst[j] = v;
        else dst_hi[j - 16] = v;
      }
      // lanes reading this block: int8 -> lanes of bytes k..k+31; int4 -> the 4 lanes of group b
      const float s = amax / 127.f;
      if (int4) {
        for (int d = 0; d < 4; ++d) li[16 * (b / 4) + 4 * (b % 4) + d] = s;
      } else {
        for (int d = 0; d < 8; ++d) li[16 * (b / 2) + 8 * (b % 2) + d] = s;
      }
      // group sums for the offset (G = 16: two groups per block)
      for (int64_t g = b * ACT_BLOCK / G; g < (b + 1) * ACT_BLOCK / G; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += qi[act_position(k, K, int4)];
        gi[g] = s * (float)sum;
      }
    }
    // unused lanes of a 32-byte tail step
    if (rowbytes % 64) for (int d = 8; d < 16; ++d) li[16 * (ns - 1) + d] = 0.f;
    // -128 * sum of each lane's 4 activations (int8 codes, unsigned dot products)
    for (int64_t c = 0; c < ns; ++c)
      for (int d = 0; d < 16; ++d) {
        int32_t sum = 0;
        if (!int4 && 64 * c + 4 * d < K)
          for (int e = 0; e < 4; ++e) sum += qi[64 * c + 4 * d + e];
        bi[16 * c + d] = -128 * sum;
      }
  }
}

void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
  for (int64_t i = 0; i < M * (K / G); ++i) {
    float s = 0.f;
    for (int64_t k = 0; k < G; ++k) s += x[i * G + k];
    xsum[i] = s;
  }
}

void qmm_columns(const IsaOps* ops, const QmmArgs& a, bool q8, int64_t n0, int64_t n1) {
  if (q8) ops->qmm_q8(a, n0, n1);
  else ops->qmm_f32(a, n0, n1);
}

}  // namespace dw
