// The K-quant rule (kquant.h) on vectors, written once for every SIMD path: one vector lane per output
// column, a tile of MB activation rows sharing every decoded weight vector (an extra row costs its dot
// products and nothing else). The including header defines KV (the vector operations, W columns per
// vector), KQ_MB, KQ_DOT and kq_prefetch (kquant_x86.h, kquant_neon.h). Integer sums are exact, and the
// float steps are the rule's scalar chains, one lane per column: the same bits as kq_ref on any path.
// No std:: templates here (see x86_256.h).

// One vector of W columns: tile t's columns s*W .. s*W+W-1 (s < 16 / W: 0 on 512-bit paths, 0-1 on 256-bit, 0-3 on NEON)
struct Slot {
  const uint8_t* base;  // the tile's first super-block
  int64_t cb;           // byte offset of the slot in each 64-byte group
  int64_t cs;           // column offset of the slot in each 16-column row of scales
};

// Q4_K: NV column vectors (slots) and MB rows per pass: each activation broadcast feeds NV dot products
template <int MB, int NV>
inline void kq4_tile(const dw::KqArgs& a, const Slot* sl, int64_t m0, float* const* out, int64_t ldo) {
  using I = KV::I;
  using F = KV::F;
  const int64_t K = a.K, nb = K / dw::QK;
  const I nib = KV::set8(0x0F);
  F acc[NV][MB];
  for (int v = 0; v < NV; ++v)
    for (int i = 0; i < MB; ++i) acc[v][i] = KV::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    I S[NV][MB];
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < MB; ++i) S[v][i] = KV::zero();
    for (int c = 0; c < 4; ++c) {  // chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)
      I lo[NV][MB], hi[NV][MB];
      for (int v = 0; v < NV; ++v)
        for (int i = 0; i < MB; ++i) lo[v][i] = hi[v][i] = KV::zero();
      for (int g = 0; g < 8; ++g) {
        I wl[NV], wh[NV];
        for (int v = 0; v < NV; ++v) {
          const uint8_t* p = sl[v].base + b * dw::KQ4_TILE + dw::KQ4_QS + (8 * c + g) * 64;
          if (sl[v].cb == 0) kq_prefetch(p);
          const I Wv = KV::load(p + sl[v].cb);
          wl[v] = KV::and_(Wv, nib), wh[v] = KV::and_(KV::srl16(Wv, 4), nib);
        }
        for (int i = 0; i < MB; ++i) {
          const int8_t* x = a.act.q + (m0 + i) * K + b * dw::QK + 64 * c + 4 * g;
          const I xl = KV::bcast4(x), xh = KV::bcast4(x + 32);
          for (int v = 0; v < NV; ++v) {
#if KQ_DOT
            lo[v][i] = KV::dot(lo[v][i], wl[v], xl);
            hi[v][i] = KV::dot(hi[v][i], wh[v], xh);
#else  // int16 pair sums, the 8 groups of a chunk added in int16 (exact: at most 8 * 2 * 15 * 127)
            lo[v][i] = KV::add16(lo[v][i], KV::dot16(wl[v], xl));
            hi[v][i] = KV::add16(hi[v][i], KV::dot16(wh[v], xh));
#endif
          }
        }
      }
      for (int v = 0; v < NV; ++v) {
        const uint8_t* blk = sl[v].base + b * dw::KQ4_TILE;
        const I s0 = KV::u8to32(blk + dw::KQ4_SC + 16 * (2 * c) + sl[v].cs);
        const I s1 = KV::u8to32(blk + dw::KQ4_SC + 16 * (2 * c + 1) + sl[v].cs);
#if KQ_DOT
        for (int i = 0; i < MB; ++i) S[v][i] = KV::add(S[v][i], KV::add(KV::mul(lo[v][i], s0), KV::mul(hi[v][i], s1)));
#else  // madd with the scale in both int16 halves of each lane: sc * (the lane's 4 products), in int32
        const I p0 = KV::pair16(s0), p1 = KV::pair16(s1);
        for (int i = 0; i < MB; ++i) S[v][i] = KV::add(S[v][i], KV::add(KV::madd(lo[v][i], p0), KV::madd(hi[v][i], p1)));
#endif
      }
    }
    for (int v = 0; v < NV; ++v) {
      const uint8_t* blk = sl[v].base + b * dw::KQ4_TILE;
      if (sl[v].cb == 0)
        for (int l = 0; l < 5; ++l) kq_prefetch(blk + dw::KQ4_SC + 64 * l);  // sc, m, d, dmin
      I Mn[MB];
      for (int i = 0; i < MB; ++i) Mn[i] = KV::zero();
      for (int j = 0; j < 8; ++j) {
        const I mj = KV::u8to32(blk + dw::KQ4_M + 16 * j + sl[v].cs);
        for (int i = 0; i < MB; ++i)
          Mn[i] = KV::add(Mn[i], KV::mul(mj, KV::set32(a.act.b32[(m0 + i) * (K / 32) + 8 * b + j])));
      }
      const F d = KV::h2f(blk + dw::KQ4_D + 2 * sl[v].cs), dm = KV::h2f(blk + dw::KQ4_DMIN + 2 * sl[v].cs);
      for (int i = 0; i < MB; ++i) {
        const F dx = KV::fset(a.act.d[(m0 + i) * nb + b]);
        acc[v][i] = KV::fma(KV::cvt(S[v][i]), KV::fmul(d, dx), acc[v][i]);
        acc[v][i] = KV::fnma(KV::cvt(Mn[i]), KV::fmul(dm, dx), acc[v][i]);
      }
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int i = 0; i < MB; ++i) KV::store(out[v] + i * ldo, acc[v][i]);
}

// Q6_K: NV column vectors (slots) and MB rows per pass
template <int MB, int NV>
inline void kq6_tile(const dw::KqArgs& a, const Slot* sl, int64_t m0, float* const* out, int64_t ldo) {
  using I = KV::I;
  using F = KV::F;
  const int64_t K = a.K, nb = K / dw::QK;
  const I nib = KV::set8(0x0F), m2 = KV::set8(0x03), m4 = KV::set8(0x0C), m6 = KV::set8(0x30);
  F acc[NV][MB];
  for (int v = 0; v < NV; ++v)
    for (int i = 0; i < MB; ++i) acc[v][i] = KV::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    I S[NV][MB];
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < MB; ++i) S[v][i] = KV::zero();
    for (int h = 0; h < 2; ++h) {
      for (int q4 = 0; q4 < 2; ++q4) {  // groups p = 4 q4 .. 4 q4 + 3: sub-blocks 8h + 2k + q4, k = 0..3
        I A[NV][4][MB];
        for (int i = 0; i < MB; ++i) {
          const int32_t* bn = a.act.b16n + (m0 + i) * (K / 16) + 16 * b + 8 * h + q4;
          for (int v = 0; v < NV; ++v)
            for (int k = 0; k < 4; ++k) A[v][k][i] = KV::set32(bn[2 * k]);
        }
        for (int p = 4 * q4; p < 4 * q4 + 4; ++p) {
          I u[NV][4];
          for (int v = 0; v < NV; ++v) {
            const uint8_t* blk = sl[v].base + b * dw::KQ6_TILE;
            const uint8_t *pa = blk + dw::KQ6_QL + (16 * h + p) * 64, *pb = blk + dw::KQ6_QL + (16 * h + 8 + p) * 64,
                          *ph = blk + dw::KQ6_QH + (8 * h + p) * 64;
            if (sl[v].cb == 0) kq_prefetch(pa), kq_prefetch(pb), kq_prefetch(ph);
            const I Av = KV::load(pa + sl[v].cb), Bv = KV::load(pb + sl[v].cb), H = KV::load(ph + sl[v].cb);
            u[v][0] = KV::or_(KV::and_(Av, nib), KV::sll16(KV::and_(H, m2), 4));
            u[v][1] = KV::or_(KV::and_(Bv, nib), KV::sll16(KV::and_(H, m4), 2));
            u[v][2] = KV::or_(KV::and_(KV::srl16(Av, 4), nib), KV::and_(H, m6));
            u[v][3] = KV::or_(KV::and_(KV::srl16(Bv, 4), nib), KV::and_(KV::srl16(H, 2), m6));
          }
          for (int i = 0; i < MB; ++i) {
            const int8_t* x = a.act.q + (m0 + i) * K + b * dw::QK + 128 * h + 4 * p;
            for (int k = 0; k < 4; ++k) {
              const I xb = KV::bcast4(x + 32 * k);
              for (int v = 0; v < NV; ++v) A[v][k][i] = KV::dot(A[v][k][i], u[v][k], xb);
            }
          }
        }
        for (int v = 0; v < NV; ++v) {
          const uint8_t* sc = sl[v].base + b * dw::KQ6_TILE + dw::KQ6_SC + 16 * (8 * h + q4) + sl[v].cs;
          const I s0 = KV::i8to32(sc), s1 = KV::i8to32(sc + 32), s2 = KV::i8to32(sc + 64), s3 = KV::i8to32(sc + 96);
          for (int i = 0; i < MB; ++i)
            S[v][i] = KV::add(S[v][i], KV::add(KV::add(KV::mul(A[v][0][i], s0), KV::mul(A[v][1][i], s1)),
                                               KV::add(KV::mul(A[v][2][i], s2), KV::mul(A[v][3][i], s3))));
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const uint8_t* blk = sl[v].base + b * dw::KQ6_TILE;
      if (sl[v].cb == 0)
        for (int l = 0; l < 5; ++l) kq_prefetch(blk + dw::KQ6_SC + 64 * l);  // sc, d, padding
      const F d = KV::h2f(blk + dw::KQ6_D + 2 * sl[v].cs);
      for (int i = 0; i < MB; ++i)
        acc[v][i] = KV::fma(KV::cvt(S[v][i]), KV::fmul(d, KV::fset(a.act.d[(m0 + i) * nb + b])), acc[v][i]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int i = 0; i < MB; ++i) KV::store(out[v] + i * ldo, acc[v][i]);
}

#ifndef KQ_NV
#define KQ_NV 1  // slots per pass (2, sharing each broadcast between two vectors, measured slower: registers)
#endif

template <int MB, int NV>
inline void kq_tile(const dw::KqArgs& a, const Slot* sl, int64_t m0, float* const* out, int64_t ldo) {
  if (a.fmt == dw::kKq4) kq4_tile<MB, NV>(a, sl, m0, out, ldo);
  else kq6_tile<MB, NV>(a, sl, m0, out, ldo);
}

template <int MB, int NV>
inline void kq_rows(int64_t rows, const dw::KqArgs& a, const Slot* sl, int64_t m0, float* const* out, int64_t ldo) {
  if constexpr (MB > 1) {
    if (rows < MB) {
      kq_rows<MB - 1, NV>(rows, a, sl, m0, out, ldo);
      return;
    }
  }
  kq_tile<MB, NV>(a, sl, m0, out, ldo);
}

// tiles t0..t1, all rows: the tiles' column vectors (slots) taken KQ_NV at a time
void kq_qmm(const dw::KqArgs& a, int64_t t0, int64_t t1) {
  constexpr int SPT = 16 / KV::W;  // slots per tile
  const int64_t nb = a.K / dw::QK, tile = dw::kq_tile_bytes(a.fmt), s0 = t0 * SPT, s1 = t1 * SPT;
  float tmp[KQ_NV][KQ_MB * 16];
  for (int64_t first = s0; first < s1; first += KQ_NV) {
    const int nv = s1 - first < KQ_NV ? (int)(s1 - first) : KQ_NV;
    Slot sl[KQ_NV];
    int64_t col[KQ_NV], cols[KQ_NV];
    for (int v = 0; v < nv; ++v) {
      const int64_t k = first + v, t = k / SPT, s = k % SPT;
      sl[v] = {a.w + t * nb * tile, 4 * KV::W * s, KV::W * s};
      col[v] = t * dw::KQ_COLS + KV::W * s;  // first column of the slot
      cols[v] = a.N - col[v] < KV::W ? a.N - col[v] : KV::W;  // real columns in it (<= 0: padding only)
    }
    for (int64_t m0 = 0; m0 < a.M; m0 += KQ_MB) {
      const int64_t rows = a.M - m0 < KQ_MB ? a.M - m0 : KQ_MB;
      float* out[KQ_NV];
      bool partial = false;
      for (int v = 0; v < nv; ++v) partial |= cols[v] < KV::W;
      for (int v = 0; v < nv; ++v) out[v] = partial ? tmp[v] : a.out + m0 * a.N + col[v];
      const int64_t ldo = partial ? 16 : a.N;
      if (nv == KQ_NV) kq_rows<KQ_MB, KQ_NV>(rows, a, sl, m0, out, ldo);
      else kq_rows<KQ_MB, 1>(rows, a, sl, m0, out, ldo);
      if (partial)  // the last tile's padding columns were computed into scratch rows: copy the real ones
        for (int v = 0; v < nv; ++v)
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < cols[v]; ++c) a.out[(m0 + i) * a.N + col[v] + c] = tmp[v][i * 16 + c];
    }
  }
}
