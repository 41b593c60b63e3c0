// Per-call work around the matmul on x86 (AVX2; the AVX-512 paths use it too): int8 quantization of the
// activations, the fused silu(gate) * up, and the pieces of decode attention (head_dot, exp_sum,
// head_values; the scaffold is attend.h). Included inside the anonymous namespace of x86_256.h and
// x86_512.h, so each path compiles its own copy under its `#pragma GCC target`. All compute exactly the
// bits of their scalar references (qmm_ref.cpp quantize_act; layers.cpp silu_mul, dw_exp, attend_items):
// the same float operations in the same order, one element per lane (no reassociation, no FMA where the
// reference has a multiply and an add), and exact integer sums. No headers (and no std::) inside.

// the rule's 16-lane sum (qmm.h tree16) of lanes 0-7 in lo and 8-15 in hi
inline float tree16(__m256 lo, __m256 hi) {
  const __m256 b = _mm256_add_ps(lo, hi);                                                // a[i] + a[i + 8]
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));  // b[i] + b[i + 4]
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                                   // c[i] + c[i + 2]
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));                          // d[0] + d[1]
}

// round to nearest even for |v| < 2^22, as dw::round_even: (v + 1.5 * 2^23) - 1.5 * 2^23
inline __m256 round_even8(__m256 v) {
  const __m256 m = _mm256_set1_ps(dw::kRoundMagic);
  return _mm256_sub_ps(_mm256_add_ps(v, m), m);
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// dw::quantize_act (qmm.h rule, step 1), 32 activations per block in four 8-lane registers
void quantize_act_x86(const float* xp, int64_t M, int64_t K, int64_t G, int64_t bits, int8_t* q, float* lane,
                      int32_t* bias, float* gs) {
  const bool int4 = bits == 4;
  const int64_t nb = K / dw::ACT_BLOCK, ng = K / G, ns = dw::nsteps(K, bits), rowbytes = K * bits / 8;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the in-lane packs
  const __m256i ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < M; ++i) {
    const float* x = xp + i * K;
    int8_t* qi = q + i * K;
    float* li = lane + i * ns * 16;
    int32_t* bi = bias + i * ns * 16;
    float* gi = gs + i * ng;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * dw::ACT_BLOCK;
      const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                   x3 = _mm256_loadu_ps(xb + 24);
      // amax, NaN ignored as the reference does: max_ps(a, m) keeps m when a is NaN, and m never is
      __m256 m = _mm256_max_ps(_mm256_and_ps(x0, absmask), _mm256_setzero_ps());
      m = _mm256_max_ps(_mm256_and_ps(x1, absmask), m);
      m = _mm256_max_ps(_mm256_and_ps(x2, absmask), m);
      m = _mm256_max_ps(_mm256_and_ps(x3, absmask), m);
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float amax = _mm_cvtss_f32(h);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      const __m256i c0 = _mm256_cvttps_epi32(round_even8(_mm256_mul_ps(x0, vinv)));
      const __m256i c1 = _mm256_cvttps_epi32(round_even8(_mm256_mul_ps(x1, vinv)));
      const __m256i c2 = _mm256_cvttps_epi32(round_even8(_mm256_mul_ps(x2, vinv)));
      const __m256i c3 = _mm256_cvttps_epi32(round_even8(_mm256_mul_ps(x3, vinv)));
      // 32 int8 codes in natural order (|code| <= 127: the saturating packs are exact)
      const __m256i codes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3)), order);
      // a block's 16-value halves are contiguous in kernel order (act_position)
      _mm_storeu_si128((__m128i*)(qi + dw::act_position(b * dw::ACT_BLOCK, K, int4)), _mm256_castsi256_si128(codes));
      _mm_storeu_si128((__m128i*)(qi + dw::act_position(b * dw::ACT_BLOCK + 16, K, int4)),
                       _mm256_extracti128_si256(codes, 1));
      const float s = amax / 127.f;
      if (int4) {
        _mm_storeu_ps(li + 16 * (b / 4) + 4 * (b % 4), _mm_set1_ps(s));
      } else {
        _mm256_storeu_ps(li + 16 * (b / 2) + 8 * (b % 2), _mm256_set1_ps(s));
        // -128 * the sum of each lane's 4 codes: lanes 8 (b % 2) .. + 7 of step b / 2
        const __m256i four = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16);
        _mm256_storeu_si256((__m256i*)(bi + 16 * (b / 2) + 8 * (b % 2)), _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), four), 7));
      }
      if (G == 32) {
        gi[b] = s * (float)hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)));
      } else {  // G == 16: two groups per block
        gi[2 * b] = s * (float)hsum8_epi32(_mm256_add_epi32(c0, c1));
        gi[2 * b + 1] = s * (float)hsum8_epi32(_mm256_add_epi32(c2, c3));
      }
    }
    if (int4) __builtin_memset(bi, 0, ns * 16 * sizeof(int32_t));  // only int8 codes read the bias
    if (rowbytes % 64) {  // unused lanes of a 32-byte tail step
      for (int d = 8; d < 16; ++d) li[16 * (ns - 1) + d] = 0.f, bi[16 * (ns - 1) + d] = 0;
    }
  }
}

// dw::dw_exp on 8 lanes: the same Cephes polynomial, the same operations (no FMA), the same special cases
inline __m256 exp8(__m256 x) {
  const __m256 n = round_even8(_mm256_mul_ps(x, _mm256_set1_ps(dw::kExpLog2e)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(dw::kExpLn2Hi)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(dw::kExpLn2Lo)));
  __m256 p = _mm256_set1_ps(dw::kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(dw::kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  // y * 2^n; n = 128 (x just below the overflow bound) scales by 2^127 and then 2
  const __m256i ni = _mm256_cvttps_epi32(n);
  const __m256i big = _mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127));
  const __m256i e = _mm256_min_epi32(ni, _mm256_set1_epi32(127));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  const __m256 ys = _mm256_mul_ps(y, scale);
  __m256 res = _mm256_blendv_ps(ys, _mm256_mul_ps(ys, _mm256_set1_ps(2.0f)), _mm256_castsi256_ps(big));
  res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(dw::kExpLo), _CMP_LT_OQ));
  res = _mm256_blendv_ps(res, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, _mm256_set1_ps(dw::kExpHi), _CMP_GT_OQ));
  return _mm256_blendv_ps(res, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN in, NaN out
}

// dw::silu_mul: out = gate / (1 + exp(-gate)) * up
void silu_mul_x86(const float* gu, int64_t M, int64_t F, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* a = gu + m * 2 * F;
    const float* b = a + F;
    float* o = out + m * F;
    int64_t j = 0;
    for (; j + 8 <= F; j += 8) {
      const __m256 g = _mm256_loadu_ps(a + j);
      const __m256 den = _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(g, den), _mm256_loadu_ps(b + j)));
    }
    for (; j < F; ++j) o[j] = a[j] / (1.0f + dw::dw_exp(-a[j])) * b[j];  // the reference's tail
  }
}

// o[j0 .. j0 + 8 NR) += keys s0 .. s1 - 1 of the weighted value sum (attend.h head_values), the NR
// accumulators held in registers through the pass over the keys
template <int NR>
inline void values_chunk(const float* p, float inv, const float* V, int64_t L, const int64_t* seen, int64_t s0,
                         int64_t s1, int64_t hd, int64_t j0, float* o) {
  __m256 acc[NR];
  for (int l = 0; l < NR; ++l) acc[l] = s0 ? _mm256_loadu_ps(o + j0 + 8 * l) : _mm256_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const __m256 w = _mm256_set1_ps(p[s] * inv);
    const float* v = V + (s < L || !seen ? s : L + seen[s - L]) * hd + j0;
    for (int l = 0; l < NR; ++l) acc[l] = _mm256_add_ps(acc[l], _mm256_mul_ps(w, _mm256_loadu_ps(v + 8 * l)));
  }
  for (int l = 0; l < NR; ++l) _mm256_storeu_ps(o + j0 + 8 * l, acc[l]);
}

inline void head_values(const float* p, float inv, const float* V, int64_t L, const int64_t* seen, int64_t s0,
                        int64_t s1, int64_t hd, float* o) {
  if (hd % 64) {
    for (int64_t j0 = 0; j0 < hd; j0 += 32) values_chunk<4>(p, inv, V, L, seen, s0, s1, hd, j0, o);
  } else {
    for (int64_t j0 = 0; j0 < hd; j0 += 64) values_chunk<8>(p, inv, V, L, seen, s0, s1, hd, j0, o);
  }
}

// layers.cpp dot16 (16 lanes of multiply-then-add, tree16); HD > 0: the head size known at compile time
template <int64_t HD>
inline float dot_lanes(const float* q, const float* k, int64_t hd) {
  if (HD) hd = HD;
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t j = 0; j < hd; j += 16) {
    lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k + j + 8)));
  }
  return tree16(lo, hi);
}

inline float head_dot(const float* q, const float* k, int64_t hd) {  // the common head sizes unrolled
  return hd == 128 ? dot_lanes<128>(q, k, hd) : hd == 64 ? dot_lanes<64>(q, k, hd) : dot_lanes<0>(q, k, hd);
}

inline float exp_sum(float* p, int64_t S, float mx) {
  __m256 slo = _mm256_setzero_ps(), shi = _mm256_setzero_ps();
  const __m256 vmx = _mm256_set1_ps(mx);
  int64_t s = 0;
  for (; s + 16 <= S; s += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), vmx));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s + 8), vmx));
    _mm256_storeu_ps(p + s, e0), _mm256_storeu_ps(p + s + 8, e1);
    slo = _mm256_add_ps(slo, e0), shi = _mm256_add_ps(shi, e1);
  }
  float sum[16];
  _mm256_storeu_ps(sum, slo), _mm256_storeu_ps(sum + 8, shi);
  for (; s < S; ++s) {
    p[s] = dw::dw_exp(p[s] - mx);
    sum[s % 16] = sum[s % 16] + p[s];
  }
  return dw::tree16(sum);
}

#include "attend.h"  // attend_groups_simd
