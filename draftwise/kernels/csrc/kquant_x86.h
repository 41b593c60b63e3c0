// The K-quant rule's vector operations on x86 (KV: one lane per output column), included by the path files
// (qmm_avx2.cpp, qmm_avxvnni.cpp, qmm_avx512.cpp, qmm_avx512vnni.cpp, through x86_256.h / x86_512.h) inside
// their anonymous namespace, after their `#pragma GCC target`, with KQ_BITS (256 | 512) and DW_VNNI set.
// The kernel itself is kquant_tiles.h. A 256-bit vector holds 8 columns: such paths run a tile as two
// slots (the second one's bytes are the second 32 of every 64 of the tile, read again from L1 / L2).
#include "kquant.h"

#define KQ_DOT DW_VNNI  // a 4-byte dot product instruction (vpdpbusd); else int16 pair sums (maddubs)

#if KQ_BITS == 512
struct KV {
  using I = __m512i;
  using F = __m512;
  static constexpr int W = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I srl16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I set8(int v) { return _mm512_set1_epi8((char)v); }
  static I set32(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I u8to32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I i8to32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I bcast4(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return _mm512_set1_epi32(v); }
  // acc + the 4-byte dot products of unsigned w with signed x in every 32-bit lane
  static I dot(I acc, I w, I x) {
#if DW_VNNI
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
  }
  // without VNNI: the int16 pair sums of unsigned w times signed x (at most 2 * 15 * 127 for 4-bit w, so
  // eight of them add up in int16 exactly), and int32 lanes of pair sums times a per-lane int16 scale
  static I dot16(I w, I x) { return _mm512_maddubs_epi16(w, x); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I madd(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I pair16(I a) { return _mm512_or_si512(a, _mm512_slli_epi32(a, 16)); }  // (v, v) in each 32-bit lane, v < 2^15
  static F h2f(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b = fma(a, -b, c)
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#else
struct KV {
  using I = __m256i;
  using F = __m256;
  static constexpr int W = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I set8(int v) { return _mm256_set1_epi8((char)v); }
  static I set32(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I u8to32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I i8to32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I bcast4(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return _mm256_set1_epi32(v); }
  static I dot(I acc, I w, I x) {
#if DW_VNNI
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
  }
  static I dot16(I w, I x) { return _mm256_maddubs_epi16(w, x); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I madd(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I pair16(I a) { return _mm256_or_si256(a, _mm256_slli_epi32(a, 16)); }
  static F h2f(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
};
#endif

#ifndef KQ_MB512
#define KQ_MB512 4
#endif
#ifndef KQ_MB256
#define KQ_MB256 4
#endif
constexpr int KQ_MB = KQ_BITS == 512 ? KQ_MB512 : KQ_MB256;  // activation rows per pass over a tile (measured)
#ifndef KQ_PF
#define KQ_PF 4096  // bytes ahead prefetched: each 64-byte line read also asks for the line this far on
#endif
inline void kq_prefetch(const uint8_t* p) { _mm_prefetch((const char*)(p + KQ_PF), _MM_HINT_T0); }

#include "kquant_tiles.h"  // kq_qmm
