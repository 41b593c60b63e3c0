// The K-quant rule (kquant.h) in plain C++: the activation quantization every path uses, the reference
// product every SIMD path must equal bit for bit, and the reference de-quantization. (The GGUF -> x16
// re-layout is gguf/kquant_pack.cpp.)
#include "core/kquant.h"

#include <cmath>

#include "core/qmm.h"  // round_even, half_to_float

namespace dw {

void act_q8b(const float* xp, int64_t M, int64_t K, int8_t* q, float* d, int32_t* bsum) {
  const int64_t nb = K / KB;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = xp + i * K + b * KB;
      float amax = 0.f;
      for (int64_t k = 0; k < KB; ++k) {
        const float v = std::fabs(x[k]);
        amax = v > amax ? v : amax;  // NaN never wins
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      d[i * nb + b] = amax / 127.f;
      int8_t* qb = q + i * K + b * KB;
      int32_t sum = 0;
      for (int64_t k = 0; k < KB; ++k) sum += qb[k] = (int8_t)round_even(x[k] * inv);
      bsum[i * nb + b] = sum;
    }
}

void act_q8k(const float* xp, int64_t M, int64_t K, int8_t* q, float* d, int32_t* b16n, int32_t* b32, uint8_t* e) {
  const int64_t nb = K / QK;
  for (int64_t i = 0; i < M; ++i) {
    const float* x = xp + i * K;
    int8_t* qi = q + i * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * QK;
      float amax = 0.f, a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t k = 0; k < QK; ++k) {
        const float v = std::fabs(xb[k]);
        a[k / 32] = v > a[k / 32] ? v : a[k / 32];  // NaN never wins
      }
      for (int j = 0; j < 8; ++j) amax = a[j] > amax ? a[j] : amax;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      d[i * nb + b] = (amax / 127.f) * 0.125f;
      int8_t* qb = qi + b * QK;
      for (int j = 0; j < 8; ++j) {
        const int s = kq_doublings(a[j], amax);
        const float mul = inv * (float)(1 << s);
        for (int64_t k = 32 * j; k < 32 * j + 32; ++k) qb[k] = (int8_t)round_even(xb[k] * mul);
        const int sh = 3 - s;
        e[i * (K / 32) + b * 8 + j] = (uint8_t)sh;
        int32_t sum = 0;
        for (int64_t k = 32 * j; k < 32 * j + 32; ++k) sum += qb[k];
        b32[i * (K / 32) + b * 8 + j] = sum * (1 << sh);
      }
      for (int64_t j = 0; j < QK / 16; ++j) {
        int32_t s = 0;
        for (int64_t k = 16 * j; k < 16 * j + 16; ++k) s += qb[k];
        b16n[i * (K / 16) + b * 16 + j] = -32 * s;
      }
    }
  }
}

void kq_act_lanes(int64_t m0, int64_t m1, int64_t K, const int32_t* b32, const uint8_t* e, int32_t* e32, int32_t* b32p) {
  for (int64_t i = m0 * (K / 32); i < m1 * (K / 32); ++i) e32[i] = e[i];
  for (int64_t i = m0 * (K / 64); i < m1 * (K / 64); ++i)
    b32p[i] = (int32_t)(((uint32_t)(uint16_t)(int16_t)b32[2 * i + 1] << 16) | (uint16_t)(int16_t)b32[2 * i]);
}

namespace {

inline float h2f(const uint8_t* p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

// the tile super-block holding column n's block b, and n's place (0..15) in it
inline const uint8_t* block_of(const uint8_t* w, int fmt, int64_t K, int64_t n, int64_t b, int* c) {
  *c = (int)(n % KQ_COLS);
  return w + ((n / KQ_COLS) * (K / QK) + b) * kq_tile_bytes(fmt);
}

// column c's 6-bit code of value v (0..255) of a Q6_K tile block
inline int q6_code(const uint8_t* blk, int c, int v) {
  const int h = v / 128, r = v % 128, part = r / 32, l = r % 32;  // ql byte: 64h + 32 (part & 1) + l
  const int qlb = 64 * h + 32 * (part & 1) + l, qhb = 32 * h + l;
  const uint8_t ql = blk[KQ6_QL + ((qlb / 4) * 16 + c) * 4 + qlb % 4];
  const uint8_t qh = blk[KQ6_QH + ((qhb / 4) * 16 + c) * 4 + qhb % 4];
  const int lo = part < 2 ? (ql & 15) : (ql >> 4);
  return lo | (((qh >> (2 * part)) & 3) << 4);
}

// a block format's code of value v (0..31) of column n's block b: the file's unsigned u (Q4_0 / Q4_1 /
// Q5_0) or Q8_0's signed q; and its d (m: Q4_1's min)
struct KbCol {
  const uint8_t* base;  // the tile
  KbRegions r;
  int64_t b;
  int c;
  int code(int fmt, int v) const {
    if (fmt == kKb80) return (int8_t)base[r.qs + b * r.qs_block + ((v / 4) * 16 + c) * 4 + v % 4];
    const int j = v % 16, g = j / 4, i = j % 4;
    const uint8_t byte = base[r.qs + b * r.qs_block + (g * 16 + c) * 4 + i];
    int u = v < 16 ? (byte & 15) : (byte >> 4);
    if (fmt == kKb50) u |= ((base[r.qh + b * 64 + c * 4 + i] >> (v < 16 ? g : 4 + g)) & 1) << 4;
    return u;
  }
  float d() const { return h2f(base + r.d + b * 32 + 2 * c); }
  float m() const { return h2f(base + r.m + b * 32 + 2 * c); }
};

inline KbCol kb_col(const uint8_t* w, int fmt, int64_t K, int64_t n, int64_t b) {
  const int64_t nb = K / KB;
  return {w + (n / KQ_COLS) * nb * kq_tile_bytes(fmt), kb_regions(fmt, nb), b, (int)(n % KQ_COLS)};
}

// the block formats' reference (kquant.h BLOCK FORMATS), one column at a time
void kb_ref(const KqArgs& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, nb = K / KB;
  const int fmt = a.fmt, off = kb_code_offset(fmt);
  for (int64_t n = t0 * KQ_COLS; n < t1 * KQ_COLS && n < a.N; ++n)
    for (int64_t m = 0; m < a.M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const KbCol col = kb_col(a.w, fmt, K, n, b);
        const int8_t* xb = a.act.q + m * K + b * KB;
        const int32_t bsum = a.act.b32[m * nb + b];
        int32_t I = -off * bsum;
        for (int v = 0; v < 32; ++v) I += col.code(fmt, v) * xb[v];
        const float dx = a.act.d[m * nb + b];
        acc = std::fma((float)I, col.d() * dx, acc);
        if (fmt == kKb41) acc = std::fma((float)bsum, col.m() * dx, acc);
      }
      a.out[m * a.N + n] = acc;
    }
}

// column c's 4-bit code of value v of a Q4_K tile block
inline int q4_code(const uint8_t* blk, int c, int v) {
  const int chunk = v / 64, r = v % 64, byte = 32 * chunk + r % 32;
  const uint8_t b = blk[KQ4_QS + ((byte / 4) * 16 + c) * 4 + byte % 4];
  return r < 32 ? (b & 15) : (b >> 4);
}

}  // namespace

void kq_ref(const KqArgs& a, int64_t t0, int64_t t1) {
  if (kq_is_block(a.fmt)) {
    kb_ref(a, t0, t1);
    return;
  }
  const int64_t K = a.K, nb = K / QK;
  for (int64_t n = t0 * KQ_COLS; n < t1 * KQ_COLS && n < a.N; ++n) {
    for (int64_t m = 0; m < a.M; ++m) {
      const int8_t* x = a.act.q + m * K;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int c;
        const uint8_t* blk = block_of(a.w, a.fmt, K, n, b, &c);
        const float dx = a.act.d[m * nb + b];
        const int8_t* xb = x + b * QK;
        const uint8_t* ex = a.act.e + m * (K / 32) + 8 * b;  // the shifts of the super-block's 8 blocks
        if (a.fmt == kKq4) {
          int32_t S = 0, Mn = 0;
          for (int j = 0; j < 8; ++j) {
            int32_t I = 0;
            for (int v = 32 * j; v < 32 * j + 32; ++v) I += q4_code(blk, c, v) * xb[v];
            S += (int32_t)blk[KQ4_SC + 16 * j + c] * (I * (1 << ex[j]));
            Mn += (int32_t)blk[KQ4_M + 16 * j + c] * a.act.b32[m * (K / 32) + 8 * b + j];
          }
          const float d = h2f(blk + KQ4_D + 2 * c), dmin = h2f(blk + KQ4_DMIN + 2 * c);
          acc = std::fma((float)S, d * dx, acc);
          acc = std::fma((float)Mn, -(dmin * dx), acc);
        } else {
          int32_t S = 0;
          for (int j = 0; j < 16; ++j) {
            int32_t I = a.act.b16n[m * (K / 16) + 16 * b + j];
            for (int v = 16 * j; v < 16 * j + 16; ++v) I += q6_code(blk, c, v) * xb[v];
            S += (int32_t)(int8_t)blk[KQ6_SC + 16 * j + c] * (I * (1 << ex[j / 2]));
          }
          acc = std::fma((float)S, h2f(blk + KQ6_D + 2 * c) * dx, acc);
        }
      }
      a.out[m * a.N + n] = acc;
    }
  }
}

void kq_dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, float* out, int64_t n0, int64_t n1) {
  (void)N;
  if (kq_is_block(fmt)) {
    const int off = kb_code_offset(fmt);
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < K / KB; ++b) {
        const KbCol col = kb_col(w, fmt, K, n, b);
        const float d = col.d(), m = fmt == kKb41 ? col.m() : 0.f;
        float* o = out + (n - n0) * K + b * KB;
        for (int v = 0; v < 32; ++v) {
          const float s = d * (float)(col.code(fmt, v) - off);
          o[v] = fmt == kKb41 ? s + m : s;
        }
      }
    return;
  }
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * K;
    for (int64_t b = 0; b < nb; ++b) {
      int c;
      const uint8_t* blk = block_of(w, fmt, K, n, b, &c);
      if (fmt == kKq4) {
        const float d = h2f(blk + KQ4_D + 2 * c), dmin = h2f(blk + KQ4_DMIN + 2 * c);
        for (int v = 0; v < 256; ++v) {
          const int j = v / 32;
          const float s = d * (float)blk[KQ4_SC + 16 * j + c], mn = dmin * (float)blk[KQ4_M + 16 * j + c];
          o[b * QK + v] = s * (float)q4_code(blk, c, v) - mn;
        }
      } else {
        const float d = h2f(blk + KQ6_D + 2 * c);
        for (int v = 0; v < 256; ++v) {
          const float s = d * (float)(int8_t)blk[KQ6_SC + 16 * (v / 16) + c];
          o[b * QK + v] = s * (float)(q6_code(blk, c, v) - 32);
        }
      }
    }
  }
}

}  // namespace dw
