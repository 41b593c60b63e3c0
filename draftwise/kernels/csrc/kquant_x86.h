// The K-quant rule (kquant.h) on x86 vectors: one vector lane per output column, a tile of MB activation
// rows sharing every decoded weight vector (an extra row costs its dot products and nothing else).
// Included by the path files (qmm_avx2.cpp, qmm_avxvnni.cpp, qmm_avx512.cpp, qmm_avx512vnni.cpp) inside
// their anonymous namespace, after their `#pragma GCC target`, with KQ_BITS (256 | 512) and DW_VNNI set.
// A 256-bit vector holds 8 columns: such paths run each tile as two halves (the half's bytes are the
// second 32 of every 64 of the tile, read again from L1 / L2).
#include "kquant.h"

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

constexpr int KQ_MB = KQ_BITS == 512 ? 4 : 2;  // activation rows per pass over a tile
#ifndef KQ_PF
#define KQ_PF 4096  // bytes ahead prefetched: each 64-byte line read also asks for the line this far on
#endif
inline void kq_prefetch(const uint8_t* p) { _mm_prefetch((const char*)(p + KQ_PF), _MM_HINT_T0); }

// Q4_K: columns s*W .. s*W+W-1 of tile t, rows m0 .. m0+MB-1
template <int MB>
inline void kq4_tile(const dw::KqArgs& a, int64_t t, int s, int64_t m0, float* out, int64_t ldo) {
  using I = KV::I;
  using F = KV::F;
  const int64_t K = a.K, nb = K / dw::QK, cb = 4 * KV::W * s;  // byte offset of the half in a 64-byte group
  const uint8_t* base = a.w + t * nb * dw::KQ4_TILE;
  const I nib = KV::set8(0x0F);
  F acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = KV::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = base + b * dw::KQ4_TILE;
    I S[MB];
    for (int i = 0; i < MB; ++i) S[i] = KV::zero();
    for (int c = 0; c < 4; ++c) {  // chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)
      I lo[MB], hi[MB];
      for (int i = 0; i < MB; ++i) lo[i] = hi[i] = KV::zero();
      for (int g = 0; g < 8; ++g) {
        kq_prefetch(blk + dw::KQ4_QS + (8 * c + g) * 64);
        const I Wv = KV::load(blk + dw::KQ4_QS + (8 * c + g) * 64 + cb);
        const I wl = KV::and_(Wv, nib), wh = KV::and_(KV::srl16(Wv, 4), nib);
        for (int i = 0; i < MB; ++i) {
          const int8_t* x = a.act.q + (m0 + i) * K + b * dw::QK + 64 * c + 4 * g;
          lo[i] = KV::dot(lo[i], wl, KV::bcast4(x));
          hi[i] = KV::dot(hi[i], wh, KV::bcast4(x + 32));
        }
      }
      const I s0 = KV::u8to32(blk + dw::KQ4_SC + 16 * (2 * c) + KV::W * s);
      const I s1 = KV::u8to32(blk + dw::KQ4_SC + 16 * (2 * c + 1) + KV::W * s);
      for (int i = 0; i < MB; ++i) S[i] = KV::add(S[i], KV::add(KV::mul(lo[i], s0), KV::mul(hi[i], s1)));
    }
    for (int l = 0; l < 5; ++l) kq_prefetch(blk + dw::KQ4_SC + 64 * l);  // sc, m, d, dmin
    I Mn[MB];
    for (int i = 0; i < MB; ++i) Mn[i] = KV::zero();
    for (int j = 0; j < 8; ++j) {
      const I mj = KV::u8to32(blk + dw::KQ4_M + 16 * j + KV::W * s);
      for (int i = 0; i < MB; ++i) Mn[i] = KV::add(Mn[i], KV::mul(mj, KV::set32(a.act.b32[(m0 + i) * (K / 32) + 8 * b + j])));
    }
    const F d = KV::h2f(blk + dw::KQ4_D + 2 * KV::W * s), dm = KV::h2f(blk + dw::KQ4_DMIN + 2 * KV::W * s);
    for (int i = 0; i < MB; ++i) {
      const F dx = KV::fset(a.act.d[(m0 + i) * nb + b]);
      acc[i] = KV::fma(KV::cvt(S[i]), KV::fmul(d, dx), acc[i]);
      acc[i] = KV::fnma(KV::cvt(Mn[i]), KV::fmul(dm, dx), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) KV::store(out + i * ldo, acc[i]);
}

// Q6_K: columns s*W .. s*W+W-1 of tile t, rows m0 .. m0+MB-1
template <int MB>
inline void kq6_tile(const dw::KqArgs& a, int64_t t, int s, int64_t m0, float* out, int64_t ldo) {
  using I = KV::I;
  using F = KV::F;
  const int64_t K = a.K, nb = K / dw::QK, cb = 4 * KV::W * s;
  const uint8_t* base = a.w + t * nb * dw::KQ6_TILE;
  const I nib = KV::set8(0x0F), m2 = KV::set8(0x03), m4 = KV::set8(0x0C), m6 = KV::set8(0x30);
  F acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = KV::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = base + b * dw::KQ6_TILE;
    I S[MB];
    for (int i = 0; i < MB; ++i) S[i] = KV::zero();
    for (int h = 0; h < 2; ++h) {
      for (int q4 = 0; q4 < 2; ++q4) {  // groups p = 4 q4 .. 4 q4 + 3: sub-blocks 8h + 2k + q4, k = 0..3
        I A0[MB], A1[MB], A2[MB], A3[MB];
        for (int i = 0; i < MB; ++i) {
          const int32_t* bn = a.act.b16n + (m0 + i) * (K / 16) + 16 * b + 8 * h + q4;
          A0[i] = KV::set32(bn[0]), A1[i] = KV::set32(bn[2]), A2[i] = KV::set32(bn[4]), A3[i] = KV::set32(bn[6]);
        }
        for (int p = 4 * q4; p < 4 * q4 + 4; ++p) {
          kq_prefetch(blk + dw::KQ6_QL + (16 * h + p) * 64);
          kq_prefetch(blk + dw::KQ6_QL + (16 * h + 8 + p) * 64);
          kq_prefetch(blk + dw::KQ6_QH + (8 * h + p) * 64);
          const I A = KV::load(blk + dw::KQ6_QL + (16 * h + p) * 64 + cb);
          const I B = KV::load(blk + dw::KQ6_QL + (16 * h + 8 + p) * 64 + cb);
          const I H = KV::load(blk + dw::KQ6_QH + (8 * h + p) * 64 + cb);
          const I u0 = KV::or_(KV::and_(A, nib), KV::sll16(KV::and_(H, m2), 4));
          const I u1 = KV::or_(KV::and_(B, nib), KV::sll16(KV::and_(H, m4), 2));
          const I u2 = KV::or_(KV::and_(KV::srl16(A, 4), nib), KV::and_(H, m6));
          const I u3 = KV::or_(KV::and_(KV::srl16(B, 4), nib), KV::and_(KV::srl16(H, 2), m6));
          for (int i = 0; i < MB; ++i) {
            const int8_t* x = a.act.q + (m0 + i) * K + b * dw::QK + 128 * h + 4 * p;
            A0[i] = KV::dot(A0[i], u0, KV::bcast4(x));
            A1[i] = KV::dot(A1[i], u1, KV::bcast4(x + 32));
            A2[i] = KV::dot(A2[i], u2, KV::bcast4(x + 64));
            A3[i] = KV::dot(A3[i], u3, KV::bcast4(x + 96));
          }
        }
        const uint8_t* sc = blk + dw::KQ6_SC + 16 * (8 * h + q4) + KV::W * s;
        const I s0 = KV::i8to32(sc), s1 = KV::i8to32(sc + 32), s2 = KV::i8to32(sc + 64), s3 = KV::i8to32(sc + 96);
        for (int i = 0; i < MB; ++i)
          S[i] = KV::add(S[i], KV::add(KV::add(KV::mul(A0[i], s0), KV::mul(A1[i], s1)),
                                       KV::add(KV::mul(A2[i], s2), KV::mul(A3[i], s3))));
      }
    }
    for (int l = 0; l < 5; ++l) kq_prefetch(blk + dw::KQ6_SC + 64 * l);  // sc, d, padding
    const F d = KV::h2f(blk + dw::KQ6_D + 2 * KV::W * s);
    for (int i = 0; i < MB; ++i)
      acc[i] = KV::fma(KV::cvt(S[i]), KV::fmul(d, KV::fset(a.act.d[(m0 + i) * nb + b])), acc[i]);
  }
  for (int i = 0; i < MB; ++i) KV::store(out + i * ldo, acc[i]);
}

template <int MB>
inline void kq_tile(const dw::KqArgs& a, int64_t t, int s, int64_t m0, float* out, int64_t ldo) {
  if (a.fmt == dw::kKq4) kq4_tile<MB>(a, t, s, m0, out, ldo);
  else kq6_tile<MB>(a, t, s, m0, out, ldo);
}

template <int MB>
inline void kq_rows(int64_t rows, const dw::KqArgs& a, int64_t t, int s, int64_t m0, float* out, int64_t ldo) {
  if constexpr (MB > 1) {
    if (rows < MB) {
      kq_rows<MB - 1>(rows, a, t, s, m0, out, ldo);
      return;
    }
  }
  kq_tile<MB>(a, t, s, m0, out, ldo);
}

// tiles t0..t1, all rows
void kq_qmm(const dw::KqArgs& a, int64_t t0, int64_t t1) {
  float tmp[KQ_MB * 16];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * dw::KQ_COLS, cols = a.N - n0 < dw::KQ_COLS ? a.N - n0 : dw::KQ_COLS;
    for (int s = 0; s < 16 / KV::W; ++s) {
      const int64_t c0 = s * KV::W;
      if (c0 >= cols) break;
      for (int64_t m0 = 0; m0 < a.M; m0 += KQ_MB) {
        const int64_t rows = a.M - m0 < KQ_MB ? a.M - m0 : KQ_MB;
        if (c0 + KV::W <= cols) {
          kq_rows<KQ_MB>(rows, a, t, s, m0, a.out + m0 * a.N + n0 + c0, a.N);
        } else {  // the last tile's padding columns: computed into a scratch row, the real ones copied
          kq_rows<KQ_MB>(rows, a, t, s, m0, tmp, 16);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = c0; c < cols; ++c) a.out[(m0 + i) * a.N + n0 + c] = tmp[i * 16 + c - c0];
        }
      }
    }
  }
}
