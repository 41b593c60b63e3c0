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
#include <cmath>
#include <cstring>
#include <type_traits>
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

// f(std::integral_constant<int, MB>{}) for MB = mb (1..MB_MAX): one compiled kernel per row count
template <typename F>
inline void with_rows(int mb, F&& f) {
  switch (mb) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
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

#if defined(__AVX512VNNI__)
// ---- int8 activations x unsigned 8-bit weight codes on VNNI (act_bits = 8) ----
// Each row of x is quantized in blocks of 32 (sx = max|x| / 127, round to nearest even), the scheme
// llama.cpp uses for its Q8 activations, and vpdpbusd multiplies 64 u8 weight codes by 64 s8
// activations per instruction into 16 int32 lanes (exact). A lane never straddles a weight group or an
// activation block, so one fp32 FMA per lane and step applies scale[g] * sx. int4 steps take 64 bytes =
// 128 weights (low nibbles, then high nibbles: x is permuted to match, vnni_position); int8 steps take
// 64 weights, flipped to unsigned by q + 128 (the 128 * scale is folded into the affine offset).
// The quantization is per row and the per-row instruction sequence does not depend on M: batch-invariant.
constexpr int64_t ACT_BLOCK = 32;
constexpr int64_t PREFETCH = 2048;  // bytes of codes ahead (measured: 512 → 22.6, 2048 → 26, 8192 → 24 GB/s)

inline int64_t vnni_position(int64_t k, bool int4) {  // natural index -> position in the quantized row
  if (!int4) return k;
  const int64_t base = k - k % 128, w = k % 128, g = w / 32, j = w % 32;
  return base + (j < 16 ? 16 * g + j : 64 + 16 * g + j - 16);
}

struct ActQ8 {
  std::vector<int8_t> q;  // (M, K) quantized x in kernel order
  std::vector<float> lane;  // (M, steps * 16) x scale of each int32 lane of each step
  std::vector<float> gsum;  // (M, K / G) per weight group: sum of de-quantized x (natural order)
};

ActQ8 quantize_act(const float* xp, int64_t M, int64_t K, int64_t G, bool int4) {
  const int64_t step = int4 ? 128 : 64, steps = K / step, nb = K / ACT_BLOCK, ng = K / G;
  ActQ8 a{std::vector<int8_t>(M * K), std::vector<float>(M * steps * 16), std::vector<float>(M * ng)};
  std::vector<float> sx(nb);
  std::vector<int32_t> qi(K);
  for (int64_t i = 0; i < M; ++i) {
    const float* x = xp + i * K;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int64_t k = b * ACT_BLOCK; k < (b + 1) * ACT_BLOCK; ++k) amax = std::max(amax, std::fabs(x[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      sx[b] = amax / 127.f;
      for (int64_t k = b * ACT_BLOCK; k < (b + 1) * ACT_BLOCK; ++k) {
        qi[k] = (int32_t)std::nearbyint(x[k] * inv);
        a.q[i * K + vnni_position(k, int4)] = (int8_t)qi[k];
      }
    }
    float* lane = a.lane.data() + i * steps * 16;
    for (int64_t c = 0; c < steps; ++c)
      for (int d = 0; d < 16; ++d) lane[c * 16 + d] = sx[int4 ? 4 * c + d / 4 : 2 * c + d / 8];
    for (int64_t g = 0; g < ng; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += qi[k];
      a.gsum[i * ng + g] = sx[g * G / ACT_BLOCK] * (float)sum;
    }
  }
  return a;
}

// one weight row n against MB quantized rows of x. ws: the weight scale of each lane, gathered by sidx
// from the 2 (int8, G = 32) or 4 (int8, G = 16; int4, G = 32) group scales of the step.
template <int MB, bool INT4>
inline void row_kernel_vnni(const int8_t* __restrict xq, const float* __restrict xl, int64_t K,
                            const uint8_t* __restrict qn, const float* __restrict sn,
                            const float* __restrict mn /* prefetched only */, __m512i sidx,
                            int64_t sstep, float* __restrict out, int64_t N) {
  constexpr int64_t STEP = INT4 ? 128 : 64;
  const int64_t steps = K / STEP, lw = steps * 16;
  const __mmask8 smask = sstep == 4 ? 0xF : 0x3;
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < steps; ++c) {
    // software prefetch PREFETCH bytes ahead (into the next rows: each thread's rows are contiguous) lifts
    // DRAM streaming from ~22 to ~26 GB/s here; scales and mins run at a quarter of the codes' rate
    _mm_prefetch((const char*)(qn + 64 * c + PREFETCH), _MM_HINT_T0);
    if ((c & 3) == 0) {
      _mm_prefetch((const char*)(sn + sstep * c) + PREFETCH / 4, _MM_HINT_T0);
      if (mn) _mm_prefetch((const char*)(mn + sstep * c) + PREFETCH / 4, _MM_HINT_T0);
    }
    const __m512i W = _mm512_loadu_si512((const void*)(qn + 64 * c));
    const __m512 ws = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(smask, sn + sstep * c)));
    const __m512i lo = INT4 ? _mm512_and_si512(W, nib) : _mm512_xor_si512(W, flip);
    const __m512i hi = INT4 ? _mm512_and_si512(_mm512_srli_epi16(W, 4), nib) : zero;
    for (int i = 0; i < MB; ++i) {
      const int8_t* xr = xq + i * K + STEP * c;
      __m512i ia = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512((const void*)xr));
      if (INT4) ia = _mm512_dpbusd_epi32(ia, hi, _mm512_loadu_si512((const void*)(xr + 64)));
      const __m512 s = _mm512_mul_ps(ws, _mm512_loadu_ps(xl + i * lw + 16 * c));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) out[i * N] = _mm512_reduce_add_ps(acc[i]);
}
#endif
#endif

bool vnni_path(int64_t bits, int64_t K, int64_t G) {
#if defined(__AVX512VNNI__)
  return (bits == 4 && K % 128 == 0 && G == 32) || (bits == 8 && K % 64 == 0 && (G == 16 || G == 32));
#else
  return false;
#endif
}

bool w4_path(int64_t bits, int64_t K, int64_t G) {
#if defined(__AVX512F__)
  return bits == 4 && K % 128 == 0 && G == 32;
#else
  return false;
#endif
}

}  // namespace

// f(qn, sn, mn, m0, mb, on) for every weight row n (rows split across threads) and every block of up to
// MB_MAX rows of x starting at m0: qn / sn / mn point at row n's codes, scales and mins (mn may be null),
// on at out[m0, n]. Every kernel path shares this loop, so each computes a row the same way for any M.
template <typename F>
void for_row_blocks(int64_t N, int64_t M, const uint8_t* qp, int64_t qrow, const float* sp, const float* mp,
                    int64_t ng, float* op, F&& f) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* mn = mp ? mp + n * ng : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += MB_MAX)
        f(qp + n * qrow, sp + n * ng, mn, m0, (int)std::min<int64_t>(MB_MAX, M - m0), op + m0 * N + n);
    }
  });
}

// x: (M, K) f32; q: (N, K) int8 or (N, K/2) uint8; scale, minv: (N, K/G) f32 (minv may be empty).
// act_bits = 8: int8 activations on VNNI where the format allows (vnni_path), else fp32 activations.
torch::Tensor qmm(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor minv, int64_t G,
                  int64_t bits, int64_t act_bits) {
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
#if defined(__AVX512VNNI__)
  if (act_bits == 8 && vnni_path(bits, K, G)) {
    const bool int4 = bits == 4;
    const ActQ8 a = quantize_act(xp, M, K, G, int4);
    const int64_t lw = K / (int4 ? 128 : 64) * 16;
    const int64_t sstep = int4 || G == 16 ? 4 : 2;  // group scales per 64-byte step
    const __m512i sidx = sstep == 4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                    : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const float extra = int4 ? 0.f : 128.f;  // int8 codes run as q + 128
    const float* mp = has_min ? minv.data_ptr<float>() : nullptr;
    for_row_blocks(N, M, qp, qrow, sp, mp, ng, op, [&](auto qn, auto sn, auto mn, int64_t m0, int mb, float* on) {
      const int8_t* xq = a.q.data() + m0 * K;
      const float* xl = a.lane.data() + m0 * lw;
      with_rows(mb, [&](auto c) {
        constexpr int R = decltype(c)::value;
        if (int4) row_kernel_vnni<R, true>(xq, xl, K, qn, sn, mn, sidx, sstep, on, N);
        else row_kernel_vnni<R, false>(xq, xl, K, qn, sn, mn, sidx, sstep, on, N);
      });
      if (mn || extra != 0.f)
        for (int i = 0; i < mb; ++i) on[i * N] -= offset_dot(mn, sn, extra, a.gsum.data() + (m0 + i) * ng, ng);
    });
    return out;
  }
#endif
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
    for_row_blocks(N, M, qp, qrow, sp, mp, ng, op, [&](auto qn, auto sn, auto mn, int64_t m0, int mb, float* on) {
      with_rows(mb, [&](auto c) { row_kernel_w4<decltype(c)::value>(xw + m0 * K, K, qn, sn, on, N); });
      for (int i = 0; i < mb; ++i) on[i * N] -= offset_dot(mn, sn, 16.f, xsv.data() + (m0 + i) * ng, ng);
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
  for_row_blocks(N, M, qp, qrow, sp, mp, ng, op, [&](auto qn, auto sn, auto mn, int64_t m0, int mb, float* on) {
    const float* xsm = xsp ? xsp + m0 * ng : nullptr;
    const float* xm = xp + m0 * K;
    with_rows(mb, [&](auto c) {
      constexpr int R = decltype(c)::value;
      switch (bits) {
        case 4: row_kernel<R, 4>(xm, K, qn, sn, mn, xsm, G, on, N); break;
        case 8: row_kernel<R, 8>(xm, K, qn, sn, mn, xsm, G, on, N); break;
        case 16: row_kernel<R, 16>(xm, K, qn, sn, mn, xsm, G, on, N); break;
        default: row_kernel<R, 32>(xm, K, qn, sn, mn, xsm, G, on, N); break;
      }
    });
  });
  return out;
}

// (N, K) bf16 weights from the code (w = scale * q - minv in fp32, rounded to nearest even), for the bulk
// (long-prefill) path that multiplies them with torch's bf16 GEMM. Parallel over rows, 16 weights per step.
torch::Tensor dequantize_bf16(torch::Tensor q, torch::Tensor scale, torch::Tensor minv, int64_t G, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "dequantize_bf16: int4 / int8 codes");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat32, "contiguous");
  const int64_t N = q.size(0), K = q.size(1) * (bits == 4 ? 2 : 1), ng = K / G;
  TORCH_CHECK(K % 32 == 0 && G % 16 == 0 && K % G == 0, "dequantize_bf16: group layout");
  const bool has_min = minv.numel() > 0;
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kBFloat16));
  const uint8_t* qp = (const uint8_t*)q.data_ptr();
  const float* sp = scale.data_ptr<float>();
  const float* mp = has_min ? minv.data_ptr<float>() : nullptr;
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t qrow = K * bits / 8;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = qp + n * qrow;
      uint16_t* on = op + n * K;
      for (int64_t k = 0; k < K; k += 16) {
        float v[16];
        if (bits == 4) {  // per 32-group: byte j holds q[j] (low nibble) and q[j + 16] (high)
          const uint8_t* b = qn + (k / 32) * 16;
          const bool high = (k % 32) == 16;
          for (int j = 0; j < 16; ++j) v[j] = (float)(high ? b[j] >> 4 : b[j] & 15);
        } else {
          for (int j = 0; j < 16; ++j) v[j] = (float)(int8_t)qn[k + j];
        }
        const float sc = sp[n * ng + k / G], mn = mp ? mp[n * ng + k / G] : 0.f;
        for (int j = 0; j < 16; ++j) {
          float w = sc * v[j] - mn;
          uint32_t u;
          std::memcpy(&u, &w, 4);
          u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even (weights are finite)
          on[k + j] = (uint16_t)(u >> 16);
        }
      }
    }
  });
  return out;
}

torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                               torch::Tensor v_cache, std::vector<int64_t> start, int64_t nh, int64_t nkv);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gu);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmm", &qmm, "weight-only quantized matmul (CPU)");
  m.def("dequantize_bf16", &dequantize_bf16, "int4 / int8 code -> (N, K) bf16 weights");
  m.def("decode_attention", &decode_attention, "rotary + KV append + attention for short forwards (layers.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, fp32 (layers.cpp)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [gate | up] projection, fp32 (layers.cpp)");
}
