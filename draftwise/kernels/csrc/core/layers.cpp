// The small fp32 layers of a decoder step, fused: each replaces several torch ops whose per-call overhead
// (not their arithmetic) dominated a batch-1 step. Plain C++ written in a fixed operation order (16-lane
// partial sums where a reduction is long, combined by the same tree as the matmul) and compiled without
// contraction or reassociation, so every CPU and every vector width computes the same bits. exp is our own
// polynomial: libm's expf is not the same function on every system.
//
// All are row-wise, so batch-invariant: attention computes each (row, token, head) over exactly the keys
// that token sees (the cached prefix plus the new tokens up to itself), whatever the number of new tokens
// T, so verifying k tokens at once gives bit-identical outputs to decoding them one by one.
#include <cmath>
#include <cstring>

#include "core/qmm.h"

namespace dw {

namespace {

inline float dot16(const float* a, const float* b, int64_t n) {  // n % 16 == 0 or any n (lanes j % 16)
  float acc[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] = acc[l] + a[j + l] * b[j + l];
  for (; j < n; ++j) acc[j % 16] = acc[j % 16] + a[j] * b[j];
  return tree16(acc);
}

// x (hd) <- rotate(x), HF's rotate_half convention: x * cos + cat(-x[h:], x[:h]) * sin
inline void rope(float* x, const float* c, const float* s, int64_t hd) {
  const int64_t h = hd / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = x[j], b = x[j + h];
    x[j] = a * c[j] - b * s[j];
    x[j + h] = b * c[j + h] + a * s[j + h];
  }
}

}  // namespace

float dw_exp(float x) {
  if (x != x) return x;
  if (x > kExpHi) return INFINITY;
  if (x < kExpLo) return 0.f;  // below the normal range: flushed (deterministically) to zero
  const float n = round_even(x * kExpLog2e);
  float r = x - n * kExpLn2Hi;  // (qmm.h: the constants)
  r = r + n * kExpLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float y = (p * (r * r) + r) + 1.0f;
  // y * 2^n, exact: n in [-126, 128]; 2^128 is not a float, so that case scales in two steps
  const int ni = (int)n;
  const int e = ni > 127 ? 127 : ni;
  uint32_t bits = (uint32_t)(e + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return ni > 127 ? (y * scale) * 2.0f : y * scale;
}

void rms_norm(const float* x, const float* w, int64_t M, int64_t D, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * D;
    const float inv = 1.0f / std::sqrt(dot16(r, r, D) / (float)D + eps);
    float* o = out + m * D;
    for (int64_t j = 0; j < D; ++j) o[j] = w[j] * (r[j] * inv);
  }
}

void silu_mul_span(const float* a, const float* b, int64_t n, float* o) {
  for (int64_t j = 0; j < n; ++j) o[j] = a[j] / (1.0f + dw_exp(-a[j])) * b[j];
}

void silu_mul(const float* gu, int64_t M, int64_t F, float* out) {
  for (int64_t m = 0; m < M; ++m) silu_mul_span(gu + m * 2 * F, gu + m * 2 * F + F, F, out + m * F);
}

void rope_append(float* qkv, const float* cos, const float* sin, float* kc, float* vc, const int64_t* start,
                 int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t cap) {
  const int64_t W = (nh + 2 * nkv) * hd;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv + (b * T + t) * W;
      const float* c = cos + (b * T + t) * hd;
      const float* s = sin + (b * T + t) * hd;
      for (int64_t h = 0; h < nh + nkv; ++h) rope(row + h * hd, c, s, hd);
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t at = ((b * nkv + h) * cap + start[b] + t) * hd;
        std::memcpy(kc + at, row + (nh + h) * hd, hd * sizeof(float));
        std::memcpy(vc + at, row + (nh + nkv + h) * hd, hd * sizeof(float));
      }
    }
}

void attend_items(const float* qkv, const float* kc, const float* vc, const int64_t* start, int64_t B, int64_t T,
                  int64_t nh, int64_t nkv, int64_t hd, int64_t cap, float* out, int64_t i0, int64_t i1, float* p,
                  const int64_t* vis, const int64_t* nvis) {
  const int64_t W = (nh + 2 * nkv) * hd, g = nh / nkv;
  const float scale = 1.0f / std::sqrt((float)hd);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / (T * nh), t = (i / nh) % T, h = i % nh, kvh = h / g;
    const int64_t L = start[b];
    // the keys token t sees, in order: slots 0..L-1, then its visible new tokens (a tree node: its path)
    const int64_t* seen = vis ? vis + (b * T + t) * T : nullptr;
    const int64_t S = L + (vis ? nvis[b * T + t] : t + 1);
    const float* q = qkv + (b * T + t) * W + h * hd;
    const float* K = kc + (b * nkv + kvh) * cap * hd;
    const float* V = vc + (b * nkv + kvh) * cap * hd;
    auto slot = [&](int64_t s) { return s < L || !seen ? s : L + seen[s - L]; };
    float mx = -INFINITY;
    for (int64_t s = 0; s < S; ++s) {
      p[s] = dot16(q, K + slot(s) * hd, hd) * scale;
      mx = p[s] > mx ? p[s] : mx;
    }
    float sum[16] = {0};
    for (int64_t s = 0; s < S; ++s) {
      p[s] = dw_exp(p[s] - mx);
      sum[s % 16] = sum[s % 16] + p[s];
    }
    const float inv = 1.0f / tree16(sum);
    float* o = out + (b * T + t) * nh * hd + h * hd;
    for (int64_t j = 0; j < hd; ++j) o[j] = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      const float w = p[s] * inv;
      const float* v = V + slot(s) * hd;
      for (int64_t j = 0; j < hd; ++j) o[j] = o[j] + w * v[j];
    }
  }
}

void attend_groups(const float* qkv, const float* kc, const float* vc, const int64_t* start, int64_t B, int64_t T,
                   int64_t nh, int64_t nkv, int64_t hd, int64_t cap, int64_t hc, int64_t tc, float* out, int64_t i0,
                   int64_t i1, float* p, const int64_t* vis, const int64_t* nvis) {
  const int64_t per = nh / hc, nt = (T + tc - 1) / tc;
  for (int64_t i = i0; i < i1; ++i) {  // group i: items (b * T + t) * nh + head, tokens t0 .., heads h0 ..
    const int64_t b = i / (nt * per), t0 = ((i / per) % nt) * tc, h0 = (i % per) * hc;
    for (int64_t t = t0; t < t0 + tc && t < T; ++t) {
      const int64_t item = (b * T + t) * nh + h0;
      attend_items(qkv, kc, vc, start, B, T, nh, nkv, hd, cap, out, item, item + hc, p, vis, nvis);
    }
  }
}

void attend_split(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t threads, int64_t* hc_out, int64_t* tc_out) {
  auto even = [&](int64_t groups) { return (groups >= threads && groups % threads == 0) || groups >= 4 * threads; };
  const int64_t g = nh / nkv;
  int64_t hc = 1, tc = 1;
  for (int64_t h = g; h > 1; --h)
    if (g % h == 0 && even(attend_groups_count(B, T, nh, h, 1))) {
      hc = h;
      break;
    }
  for (int64_t nt = 1; nt < T; ++nt)  // nt chunks of equal length (the last one at most shorter)
    if (even(attend_groups_count(B, T, nh, hc, (T + nt - 1) / nt))) {
      tc = (T + nt - 1) / nt;
      break;
    }
  *hc_out = hc, *tc_out = tc;
}

void dequantize_bf16_rows(const uint8_t* q, const float* scale, const float* minv, int64_t K, int64_t G,
                          int64_t bits, uint16_t* out, int64_t n0, int64_t n1) {
  const int64_t ng = K / G, qrow = K * bits / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * qrow;
    uint16_t* on = out + n * K;
    for (int64_t k = 0; k < K; ++k) {
      float v;
      if (bits == 4) {
        const int64_t j = k % 32, b = (k / 32) * 16;
        v = (float)(j < 16 ? (qn[b + j] & 15) : (qn[b + j - 16] >> 4));
      } else {
        v = (float)(int8_t)qn[k];
      }
      const float w = scale[n * ng + k / G] * v - (minv ? minv[n * ng + k / G] : 0.f);
      uint32_t u;
      std::memcpy(&u, &w, 4);
      u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even (weights are finite)
      on[k] = (uint16_t)(u >> 16);
    }
  }
}

}  // namespace dw
