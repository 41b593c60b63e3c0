// The tiling and row-block dispatch every instruction-set path shares. Included textually at the end of
// x86_256.h, x86_512.h and neon.h, inside their anonymous namespace (so each path gets its own internal
// copy, compiled under that path's `#pragma GCC target`): the including header defines MB_MAX and the
// kernels column_q8<MB, INT4>(a, n, m0) and column_f32<MB, BITS>(a, n, m0). No #include here.

// F<MB>::run for the largest MB <= rows (rows >= 1): the block of activation rows one column kernel takes
template <template <int> class F, int MB>
inline void run_rows(int64_t rows, const QmmArgs& a, int64_t n, int64_t m0) {
  if constexpr (MB > 1) {
    if (rows < MB) {
      run_rows<F, MB - 1>(rows, a, n, m0);
      return;
    }
  }
  F<MB>::run(a, n, m0);
}

template <template <int> class F>
inline void for_blocks(const QmmArgs& a, int64_t n0, int64_t n1) {
  // Tiles: a block of weight rows (kept in L2) against each block of MB_MAX activation rows (in L1), so
  // that a long prefill does not re-stream all of x for every output column. Each (row, column) is still
  // computed by the same instruction sequence, so the tiling changes no bit.
  const int64_t rowbytes = a.K * a.bits / 8, fit = (256 << 10) / rowbytes;  // weight rows in 256 KiB
  const int64_t nb = a.M <= MB_MAX ? n1 - n0 : (fit < 1 ? 1 : fit > 64 ? 64 : fit);
  for (int64_t b0 = n0; b0 < n1; b0 += nb) {
    const int64_t b1 = b0 + nb < n1 ? b0 + nb : n1;
    for (int64_t m0 = 0; m0 < a.M; m0 += MB_MAX)
      for (int64_t n = b0; n < b1; ++n) run_rows<F, MB_MAX>(a.M - m0, a, n, m0);
  }
}

template <int MB> struct Q8Int4 { static void run(const QmmArgs& a, int64_t n, int64_t m0) { column_q8<MB, true>(a, n, m0); } };
template <int MB> struct Q8Int8 { static void run(const QmmArgs& a, int64_t n, int64_t m0) { column_q8<MB, false>(a, n, m0); } };
template <int MB> struct F32W4 { static void run(const QmmArgs& a, int64_t n, int64_t m0) { column_f32<MB, 4>(a, n, m0); } };
template <int MB> struct F32W8 { static void run(const QmmArgs& a, int64_t n, int64_t m0) { column_f32<MB, 8>(a, n, m0); } };
template <int MB> struct F32W16 { static void run(const QmmArgs& a, int64_t n, int64_t m0) { column_f32<MB, 16>(a, n, m0); } };
template <int MB> struct F32W32 { static void run(const QmmArgs& a, int64_t n, int64_t m0) { column_f32<MB, 32>(a, n, m0); } };

void qmm_q8(const QmmArgs& a, int64_t n0, int64_t n1) {
  if (a.bits == 4) for_blocks<Q8Int4>(a, n0, n1);
  else for_blocks<Q8Int8>(a, n0, n1);
}

void qmm_f32(const QmmArgs& a, int64_t n0, int64_t n1) {
  switch (a.bits) {
    case 4: for_blocks<F32W4>(a, n0, n1); break;
    case 8: for_blocks<F32W8>(a, n0, n1); break;
    case 16: for_blocks<F32W16>(a, n0, n1); break;
    default: for_blocks<F32W32>(a, n0, n1); break;
  }
}
