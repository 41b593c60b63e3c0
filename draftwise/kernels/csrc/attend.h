// Decode attention shared by the SIMD paths, included textually (like tiles.h) inside the anonymous
// namespace of x86_act.h and neon_act.h after they define the three per-path pieces:
//   float head_dot(const float* q, const float* k, int64_t hd)      layers.cpp dot16 (hd % 32 == 0)
//   float exp_sum(float* p, int64_t S, float mx)                     p[s] = dw_exp(p[s] - mx) in place;
//                                                                    returns tree16 of the 16-lane sum
//   void head_values(const float* p, float inv, const float* V, int64_t L, const int64_t* seen,
//                    int64_t s0, int64_t s1, int64_t hd, float* o)   o[j] (+)= (p[s] * inv) * v[s][j],
//                                                                    keys s0..s1-1 in order (from 0 if s0 == 0)
// IsaOps::attend_groups: dw::attend_items for the hc query heads of each group (row, token, heads sharing a
// KV head; see qmm.h attend_groups), with the reference's bits: scores, max, exp and 16-lane sum, then each output element accumulating the keys in
// order. The group's heads share each block of keys and values while it is in L1 (read from L2 once per
// group, not once per head). Head sizes that are not a multiple of 32, or groups over 64 heads, take the
// reference. No #include here.
void attend_groups_simd(const float* qkv, const float* kc, const float* vc, const int64_t* start, int64_t B, int64_t T,
                        int64_t nh, int64_t nkv, int64_t hd, int64_t cap, int64_t hc, float* out, int64_t i0, int64_t i1,
                        float* p, const int64_t* vis, const int64_t* nvis) {
  const int64_t W = (nh + 2 * nkv) * hd, g = hc, per = nh / hc, KB = 16;  // KB keys per block: 8 KiB at hd 128
  if (hd % 32 || g > 64) {
    dw::attend_groups(qkv, kc, vc, start, B, T, nh, nkv, hd, cap, hc, out, i0, i1, p, vis, nvis);
    return;
  }
  const float scale = 1.0f / __builtin_sqrtf((float)hd);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / (T * per), t = (i / per) % T, h0 = (i % per) * g, kvh = h0 / (nh / nkv);
    const int64_t L = start[b];
    // the keys token t sees, in order: slots 0..L-1, then its visible new tokens (a tree node: its path)
    const int64_t* seen = vis ? vis + (b * T + t) * T : nullptr;
    const int64_t S = L + (vis ? nvis[b * T + t] : t + 1);  // p holds g rows of S scores
    const float* q0 = qkv + (b * T + t) * W + h0 * hd;
    const float* K = kc + (b * nkv + kvh) * cap * hd;
    const float* V = vc + (b * nkv + kvh) * cap * hd;
    float* o0 = out + (b * T + t) * nh * hd + h0 * hd;
    float mx[64], inv[64];
    for (int64_t h = 0; h < g; ++h) mx[h] = -__builtin_inff();
    for (int64_t s0 = 0; s0 < S; s0 += KB) {
      const int64_t s1 = s0 + KB < S ? s0 + KB : S;
      for (int64_t h = 0; h < g; ++h)
        for (int64_t s = s0; s < s1; ++s) {
          const float v = head_dot(q0 + h * hd, K + (s < L || !seen ? s : L + seen[s - L]) * hd, hd) * scale;
          p[h * S + s] = v;
          mx[h] = v > mx[h] ? v : mx[h];
        }
    }
    for (int64_t h = 0; h < g; ++h) inv[h] = 1.0f / exp_sum(p + h * S, S, mx[h]);
    for (int64_t s0 = 0; s0 < S; s0 += KB) {
      const int64_t s1 = s0 + KB < S ? s0 + KB : S;
      for (int64_t h = 0; h < g; ++h) head_values(p + h * S, inv[h], V, L, seen, s0, s1, hd, o0 + h * hd);
    }
  }
}
