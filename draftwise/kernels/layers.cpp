// The small fp32 layers of a decoder step, fused: each replaces several torch ops whose per-call overhead
// (not their arithmetic) dominated a batch-1 step. All are row-wise, so batch-invariant.
//
// decode_attention: rotary embedding + KV-cache append + attention for short forwards (decode and
// verification); replaces ~35 small torch ops per layer with one call. Each (row, token, head) is
// computed by the same instruction sequence over exactly the keys that token sees (the cached prefix
// plus the new tokens up to itself), whatever the number of new tokens T: the result is batch-invariant,
// so verifying k tokens at once gives bit-identical outputs to decoding them one by one.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// x (hd) <- rotate(x) with HF's rotate_half convention: x*cos + cat(-x[h:], x[:h])*sin
inline void rope(float* __restrict x, const float* __restrict c, const float* __restrict s, int64_t hd) {
  const int64_t h = hd / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = x[j], b = x[j + h];
    x[j] = a * c[j] - b * s[j];
    x[j + h] = b * c[j + h] + a * s[j + h];
  }
}

}  // namespace

// qkv: (B, T, (nh + 2 nkv) hd) f32, the fused projection's output (modified: q and k are rotated in place)
// cos, sin: (B, T, hd) f32; k_cache, v_cache: (B, nkv, cap, hd) f32; start[b]: cached length of row b.
// Writes the T new keys / values at start[b].. and returns (B, T, nh hd).
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                               torch::Tensor v_cache, std::vector<int64_t> start, int64_t nh, int64_t nkv) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(), "qkv: (B, T, W) f32");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kv cache: contiguous f32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "cos/sin: f32");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), hd = k_cache.size(3), cap = k_cache.size(2);
  TORCH_CHECK(W == (nh + 2 * nkv) * hd && (int64_t)start.size() >= B && nh % nkv == 0, "shapes");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(start[b] + T <= cap, "KV cache overflow");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  auto out = torch::empty({B, T, nh * hd}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t g = nh / nkv;
  const float scale = 1.0f / std::sqrt((float)hd);
  // 1. rotate q and k, append k and v to the cache
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* row = qp + (b * T + t) * W;
      const float* c = cp + (b * T + t) * hd;
      const float* s = sp + (b * T + t) * hd;
      for (int64_t h = 0; h < nh + nkv; ++h) rope(row + h * hd, c, s, hd);
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t at = ((b * nkv + h) * cap + start[b] + t) * hd;
        std::copy(row + (nh + h) * hd, row + (nh + h + 1) * hd, kc + at);
        std::copy(row + (nh + nkv + h) * hd, row + (nh + nkv + h + 1) * hd, vc + at);
      }
    }
  // 2. each (row, token, head): softmax(q k^T * scale) v over its S = start + t + 1 keys
  at::parallel_for(0, B * T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (T * nh), t = (i / nh) % T, h = i % nh, kvh = h / g;
      const int64_t S = start[b] + t + 1;
      const float* q = qp + (b * T + t) * W + h * hd;
      const float* K = kc + (b * nkv + kvh) * cap * hd;
      const float* V = vc + (b * nkv + kvh) * cap * hd;
      p.resize(S);
      float mx = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        float d = 0.f;
        const float* k = K + s * hd;
#pragma omp simd reduction(+ : d)
        for (int64_t j = 0; j < hd; ++j) d += q[j] * k[j];
        p[s] = d * scale;
        mx = std::max(mx, p[s]);
      }
      float sum = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        p[s] = std::exp(p[s] - mx);
        sum += p[s];
      }
      const float inv = 1.0f / sum;
      float* o = op + (b * T + t) * nh * hd + h * hd;
      std::fill(o, o + hd, 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const float w = p[s] * inv;
        const float* v = V + s * hd;
#pragma omp simd
        for (int64_t j = 0; j < hd; ++j) o[j] += w * v[j];
      }
    }
  });
  return out;
}

// x: (M, D) f32, weight: (D) f32 -> weight * x / sqrt(mean(x^2) + eps), row by row
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.scalar_type() == torch::kFloat32,
              "rms_norm: contiguous f32");
  const int64_t D = x.size(-1), M = x.numel() / D;
  TORCH_CHECK(weight.numel() == D, "rms_norm: weight size");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < D; ++j) ss += r[j] * r[j];
    const float inv = 1.0f / std::sqrt(ss / (float)D + (float)eps);
    float* o = op + m * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) o[j] = w[j] * (r[j] * inv);
  }
  return out;
}

// gu: (..., 2F) f32 = [gate | up] -> silu(gate) * up, (..., F)
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat32 && gu.is_contiguous(), "silu_mul: contiguous f32");
  const int64_t F2 = gu.size(-1), F = F2 / 2, M = gu.numel() / F2;
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, gu.options());
  const float* g = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* a = g + m * F2;
    const float* b = a + F;
    float* o = op + m * F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) o[j] = a[j] / (1.0f + std::exp(-a[j])) * b[j];
  }
  return out;
}
