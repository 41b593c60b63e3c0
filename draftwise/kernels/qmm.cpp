// Weight-only quantized matrix multiply for CPU decoding: out = x @ dequant(W)^T.
// Also dense bf16 (bits = 16) and fp32 (bits = 32) weights, one group per row with scale 1, so that every
// weight format gets the same batch-invariant computation.
//
// W is stored per output row n as groups of G consecutive input weights with an affine code
//   w[n, k] = scale[n, g] * q[n, k] - minv[n, g],   g = k / G
// q: int8 (bits = 8, one byte per weight) or uint4 (bits = 4, two per byte: in each 32-weight group,
// byte j holds q[j] in its low nibble and q[j + 16] in its high nibble). This represents the GGUF
// k-quants (Q4_K, Q6_K, Q5_0, Q8_0, Q4_0, Q4_1, Q5_K) exactly, so nothing is re-quantized.
//
// Activations and accumulation are fp32. The int4 path for K % 128 == 0 unpacks 128 weights per step
// without shuffles (row_kernel_w4); the generic path converts 16 codes at a time. Each output row m is
// computed by exactly the same sequence of operations whatever the number of rows M, so results are
// batch-invariant (a token's logits do not depend on how many tokens share the forward pass), and
// speculative decoding stays token-exact.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

namespace {

constexpr int MB_MAX = 8;  // rows of x processed per pass over a weight row (weights stay in L1)

template <int MB, int BITS>
inline void row_kernel(const float* __restrict x, int64_t K, const uint8_t* __restrict qn,
                       const float* __restrict sn, const float* __restrict mn, const float* __restrict xs,
                       int64_t G, float* __restrict out, int64_t N) {
  const int64_t ng = K / G;
#if defined(__AVX512F__)
  // two accumulator sets (even / odd groups) halve the loop-carried FMA latency chain
  __m512 acc0[MB], acc1[MB];
  float corr0[MB], corr1[MB];
  for (int i = 0; i < MB; ++i) {
    acc0[i] = acc1[i] = _mm512_setzero_ps();
    corr0[i] = corr1[i] = 0.f;
  }
  auto group = [&](int64_t g, __m512* acc, float* corr) {
    __m512 part[MB];
    for (int i = 0; i < MB; ++i) part[i] = _mm512_setzero_ps();
    const int64_t k0 = g * G;
    if (BITS == 32 || BITS == 16) {  // dense fp32 / bf16 weights (bf16 -> fp32 is a 16-bit shift: exact)
      for (int64_t k = k0; k < k0 + G; k += 16) {
        __m512 w = BITS == 32 ? _mm512_loadu_ps((const float*)qn + k)
                              : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_loadu_si256((const __m256i*)((const uint16_t*)qn + k))), 16));
        for (int i = 0; i < MB; ++i) part[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + k), w, part[i]);
      }
    } else if (BITS == 8) {
      for (int64_t k = k0; k < k0 + G; k += 16) {
        __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qn + k))));
        for (int i = 0; i < MB; ++i) part[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + k), w, part[i]);
      }
    } else {
      for (int64_t k = k0; k < k0 + G; k += 32) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qn + k / 2)));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
        for (int i = 0; i < MB; ++i) {
          __m512 p = _mm512_mul_ps(_mm512_loadu_ps(x + i * K + k), lo);
          part[i] = _mm512_add_ps(part[i], _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + k + 16), hi, p));
        }
      }
    }
    const __m512 s = _mm512_set1_ps(sn[g]);
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(part[i], s, acc[i]);
    if (mn) for (int i = 0; i < MB; ++i) corr[i] += mn[g] * xs[i * ng + g];
  };
  int64_t g = 0;
  for (; g + 1 < ng; g += 2) {
    group(g, acc0, corr0);
    group(g + 1, acc1, corr1);
  }
  if (g < ng) group(g, acc0, corr0);
  for (int i = 0; i < MB; ++i)
    out[i * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i])) - (corr0[i] + corr1[i]);
#else
  for (int i = 0; i < MB; ++i) {
    float acc = 0.f, corr = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      float part = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        float q;
        if (BITS == 32) q = ((const float*)qn)[k];
        else if (BITS == 16) { uint32_t u = (uint32_t)((const uint16_t*)qn)[k] << 16; std::memcpy(&q, &u, 4); }
        else if (BITS == 8) q = (float)(int8_t)qn[k];
        else { int64_t j = k % 32, base = (k / 32) * 16; q = (float)(j < 16 ? (qn[base + j] & 15) : (qn[base + j - 16] >> 4)); }
        part += x[i * K + k] * q;
      }
      acc += part * sn[g];
      if (mn) corr += mn[g] * xs[i * ng + g];
    }
    out[i * N] = acc - corr;
  }
#endif
}

template <int BITS>
void dispatch_rows(int mb, const float* x, int64_t K, const uint8_t* qn, const float* sn, const float* mn,
                   const float* xs, int64_t G, float* out, int64_t N) {
  switch (mb) {
    case 1: row_kernel<1, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    case 2: row_kernel<2, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    case 3: row_kernel<3, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    case 4: row_kernel<4, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    case 5: row_kernel<5, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    case 6: row_kernel<6, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    case 7: row_kernel<7, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
    default: row_kernel<8, BITS>(x, K, qn, sn, mn, xs, G, out, N); break;
  }
}


#if defined(__AVX512F__)
// ---- int4, 128 weights (4 groups of 32, 64 bytes) per step, fp32 activations ----
// The 64 bytes are read as 16 dwords of 8 nibbles each. Nibble s of every dword is shifted to mantissa
// bits 19-22 and OR-ed into 1.0f, giving w' = 1 + q/16 exactly: 2 integer ops per 16 weights and no
// cross-lane shuffles (the int -> float conversion was the bottleneck). x is pre-permuted to match
// (w4_position), and since q = 16 (w' - 1) the caller scales by 16 * scale and folds 16 * scale * sum(x)
// into the affine offset.
inline int64_t w4_position(int64_t k) {  // natural index -> position in the permuted activation row
  const int64_t base = k - k % 128, w = k % 128;
  const int64_t r = w % 32, rem = r % 16;  // lane d = 4 * (w / 32) + rem / 4, nibble s = 2 * (rem % 4) + r / 16
  return base + 16 * (2 * (rem % 4) + r / 16) + 4 * (w / 32) + rem / 4;
}

template <int S>
inline __m512 w4_nibble(__m512i W) {  // 1 + q_s / 16 for nibble s of each dword
  const __m512i shifted = 4 * S <= 19 ? _mm512_slli_epi32(W, 19 - 4 * S) : _mm512_srli_epi32(W, 4 * S - 19);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(0xF << 19),
                                                       _mm512_set1_epi32(0x3F800000), 0xEA));  // (a & b) | c
}

template <int MB>
inline void row_kernel_w4(const float* __restrict xw, int64_t K, const uint8_t* __restrict qn,
                          const float* __restrict sn, float* __restrict out, int64_t N) {
  __m512 acc0[MB], acc1[MB];
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const __m512i sidx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 sixteen = _mm512_set1_ps(16.f);
  int64_t c = 0;
  for (int64_t k = 0; k < K; k += 128, ++c) {
    const __m512i W = _mm512_loadu_si512((const void*)(qn + k / 2));
    const __m512 v0 = w4_nibble<0>(W), v1 = w4_nibble<1>(W), v2 = w4_nibble<2>(W), v3 = w4_nibble<3>(W);
    const __m512 v4 = w4_nibble<4>(W), v5 = w4_nibble<5>(W), v6 = w4_nibble<6>(W), v7 = w4_nibble<7>(W);
    // lane d belongs to group k / 32 + d / 4
    const __m512 s = _mm512_mul_ps(sixteen, _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(sn + k / 32))));
    for (int i = 0; i < MB; ++i) {
      const float* x = xw + i * K + k;
      __m512 pa = _mm512_mul_ps(_mm512_loadu_ps(x), v0);
      __m512 pb = _mm512_mul_ps(_mm512_loadu_ps(x + 16), v1);
      pa = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32), v2, pa);
      pb = _mm512_fmadd_ps(_mm512_loadu_ps(x + 48), v3, pb);
      pa = _mm512_fmadd_ps(_mm512_loadu_ps(x + 64), v4, pa);
      pb = _mm512_fmadd_ps(_mm512_loadu_ps(x + 80), v5, pb);
      pa = _mm512_fmadd_ps(_mm512_loadu_ps(x + 96), v6, pa);
      pb = _mm512_fmadd_ps(_mm512_loadu_ps(x + 112), v7, pb);
      const __m512 part = _mm512_add_ps(pa, pb);
      if (c & 1) acc1[i] = _mm512_fmadd_ps(part, s, acc1[i]);
      else acc0[i] = _mm512_fmadd_ps(part, s, acc0[i]);
    }
  }
  for (int i = 0; i < MB; ++i) out[i * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

void dispatch_rows_w4(int mb, const float* xw, int64_t K, const uint8_t* qn, const float* sn, float* out,
                      int64_t N) {
  switch (mb) {
    case 1: row_kernel_w4<1>(xw, K, qn, sn, out, N); break;
    case 2: row_kernel_w4<2>(xw, K, qn, sn, out, N); break;
    case 3: row_kernel_w4<3>(xw, K, qn, sn, out, N); break;
    case 4: row_kernel_w4<4>(xw, K, qn, sn, out, N); break;
    case 5: row_kernel_w4<5>(xw, K, qn, sn, out, N); break;
    case 6: row_kernel_w4<6>(xw, K, qn, sn, out, N); break;
    case 7: row_kernel_w4<7>(xw, K, qn, sn, out, N); break;
    default: row_kernel_w4<8>(xw, K, qn, sn, out, N); break;
  }
}

// sum_g (minv[g] + extra * scale[g]) * xs[g], in a fixed order (minv may be null)
inline float offset_dot(const float* mn, const float* sn, float extra, const float* xs, int64_t ng) {
  __m512 c = _mm512_setzero_ps();
  const __m512 e = _mm512_set1_ps(extra);
  int64_t g = 0;
  for (; g + 16 <= ng; g += 16) {
    const __m512 o = _mm512_fmadd_ps(e, _mm512_loadu_ps(sn + g), mn ? _mm512_loadu_ps(mn + g) : _mm512_setzero_ps());
    c = _mm512_fmadd_ps(o, _mm512_loadu_ps(xs + g), c);
  }
  float corr = _mm512_reduce_add_ps(c);
  for (; g < ng; ++g) corr += ((mn ? mn[g] : 0.f) + extra * sn[g]) * xs[g];
  return corr;
}
#endif

bool w4_path(int64_t bits, int64_t K, int64_t G) {
#if defined(__AVX512F__)
  return bits == 4 && K % 128 == 0 && G == 32;
#else
  return false;
#endif
}

}  // namespace

// x: (M, K) f32; q: (N, K) int8 or (N, K/2) uint8; scale, minv: (N, K/G) f32 (minv may be empty)
torch::Tensor qmm(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor minv, int64_t G,
                  int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: (M, K) f32");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16 || bits == 32, "bits must be 4, 8, 16 (bf16) or 32 (fp32)");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous(), "q and scale must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % G == 0 && G % (bits == 4 ? 32 : 16) == 0, "bad group size");
  TORCH_CHECK(q.size(1) * q.element_size() * 8 == K * bits, "q shape does not match K");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == K / G, "scale shape");
  const bool has_min = minv.numel() > 0;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = (const uint8_t*)q.data_ptr();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qrow = K * bits / 8, ng = K / G;  // bytes per weight row
#if defined(__AVX512F__)
  if (w4_path(bits, K, G)) {
    std::vector<float> xwv(M * K), xsv(M * ng);  // permuted x; group sums of x in natural order
    float* xw = xwv.data();
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) xw[i * K + w4_position(k)] = xp[i * K + k];
      for (int64_t g = 0; g < ng; ++g) {
        float sum = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xp[i * K + k];
        xsv[i * ng + g] = sum;
      }
    }
    const float* mp = has_min ? minv.data_ptr<float>() : nullptr;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* qn = qp + n * qrow;
        const float* sn = sp + n * ng;
        const float* mn = mp ? mp + n * ng : nullptr;
        for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
          const int mb = (int)std::min<int64_t>(MB_MAX, M - m0);
          float* on = op + m0 * N + n;
          dispatch_rows_w4(mb, xw + m0 * K, K, qn, sn, on, N);
          for (int i = 0; i < mb; ++i) on[i * N] -= offset_dot(mn, sn, 16.f, xsv.data() + (m0 + i) * ng, ng);
        }
      }
    });
    return out;
  }
#endif
  // generic path: int8, int4 (K % 128 != 0), dense bf16 / fp32
  torch::Tensor xs;  // (M, K/G) group sums of x for the affine offset, summed in a fixed order per row
  if (has_min) {
    xs = torch::empty({M, K / G}, x.options());
    float* xsw = xs.data_ptr<float>();
    for (int64_t i = 0; i < M * (K / G); ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < G; ++k) s += xp[i * G + k];
      xsw[i] = s;
    }
  }
  const float* mp = has_min ? minv.data_ptr<float>() : nullptr;
  const float* xsp = has_min ? xs.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
        const int mb = (int)std::min<int64_t>(MB_MAX, M - m0);
        const float* mn = mp ? mp + n * ng : nullptr;
        const float* xsm = xsp ? xsp + m0 * ng : nullptr;
        const uint8_t* qn = qp + n * qrow;
        const float* sn = sp + n * ng;
        float* on = op + m0 * N + n;
        switch (bits) {
          case 4: dispatch_rows<4>(mb, xp + m0 * K, K, qn, sn, mn, xsm, G, on, N); break;
          case 8: dispatch_rows<8>(mb, xp + m0 * K, K, qn, sn, mn, xsm, G, on, N); break;
          case 16: dispatch_rows<16>(mb, xp + m0 * K, K, qn, sn, mn, xsm, G, on, N); break;
          default: dispatch_rows<32>(mb, xp + m0 * K, K, qn, sn, mn, xsm, G, on, N); break;
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmm", &qmm, "weight-only quantized matmul (CPU)");
}
