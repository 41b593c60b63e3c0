// draftwise CPU kernels: the numeric rule every instruction-set path implements, and the dispatch table.
//
// out = x @ dequant(W)^T for W held per output row n as groups of G consecutive input weights with an
// affine code w[n, k] = scale[n, g] * q[n, k] - minv[n, g], g = k / G. q: int8 (one byte per weight) or
// uint4 (two per byte: in each 32-weight group, byte j holds q[j] in its low nibble and q[j + 16] in its
// high nibble). Dense bf16 / fp32 weights are one group per row with scale 1 (bits = 16 / 32).
//
// THE RULE (bit-identical on every path: scalar, AVX2, AVX-VNNI, AVX-512, AVX512-VNNI, NEON, NEON dotprod)
//
// int8 activations (act_bits = 8, quantized codes):
//   1. Each row of x is quantized in blocks of 32: sx = amax / 127, qx = nearbyint(x * (127 / amax)).
//      qx is stored in kernel order (act_position): for int4 codes the 64 activations multiplying the low
//      nibbles of a 64-byte step first, then the 64 multiplying the high nibbles.
//   2. Codes are read in steps of 64 bytes (the last step of a row may be 32 bytes). Lane d (0..15) of a
//      step is the exact int32 sum over code bytes 4d..4d+3 of q * qx (int4: low-nibble and high-nibble
//      products of those bytes). A lane never straddles a weight group or an activation block.
//   3. Per lane: s = ws[d] * xs[d] (weight-group scale times activation-block scale, one rounding), then
//      acc[d] = fma(float(I[d]), s, acc[d]), steps in order. r = tree16(acc).
//   4. Affine offset (minv present): c[g % 16] = fma(minv[g], gs[g], c[g % 16]) over groups in order, where
//      gs[g] = sx(block of g) * float(sum of qx over group g). out = r - tree16(c), else out = r.
// fp32 activations (act_bits = 32, or dense weights):
//   part[l] = fma chain over the group's k with k % 16 == l (in k order, from 0) of x[k] * q[k];
//   acc[l] = fma(part[l], scale[g], acc[l]); r = tree16(acc); offset c[g % 16] = fma(minv[g], xsum[g], ..)
//   with xsum[g] the in-order float sum of x over the group; out = r - tree16(c).
// tree16(a): b[i] = a[i] + a[i + 8]; c[i] = b[i] + b[i + 4]; d[i] = c[i] + c[i + 2]; result d[0] + d[1].
//
// Every row of x is computed by the same operation sequence whatever the number of rows M, so results
// are batch-invariant, and speculative verification stays token-exact. Integer products are exact on
// every path (no saturation: |qx| <= 127; int8 codes use |q| with the sign moved onto qx, or a -128 * sum
// start for the unsigned dot products), and all float operations are explicit: the sources are compiled
// with -ffp-contract=off and without -ffast-math, so no compiler may fuse or reorder them.
//
// This header has no dependency on torch: the core compiles and is tested on its own (selftest.cpp),
// including for aarch64 under qemu-user.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dw {

struct KqArgs;  // kquant.h: the K-quant rule's call

constexpr int64_t ACT_BLOCK = 32;  // activations are quantized per row in blocks of 32 values
constexpr int64_t STEP_BYTES = 64;  // code bytes per step (16 lanes of 4 bytes)
constexpr int LANES = 16;

// Quantized activations for one call (M rows), built once per call by quantize_act (qmm_ref.cpp).
struct ActQ8 {
  const int8_t* q;      // (M, K) qx in kernel order
  const float* lane;    // (M, nsteps * 16) activation scale of each lane of each step
  const int32_t* bias;  // (M, nsteps * 16) -128 * (sum of the lane's 4 qx), for unsigned dot products of int8 codes
  const float* gs;      // (M, K / G) sx * float(sum of qx over the group), for the affine offset
};

struct QmmArgs {
  int64_t M, K, N, G, bits;  // bits: 4 / 8 codes, 16 (bf16) / 32 (fp32) dense
  const uint8_t* q;          // (N, K * bits / 8) codes
  const float* scale;        // (N, K / G)
  const float* minv;         // (N, K / G) or null
  // int8-activation path
  ActQ8 act;
  // fp32-activation path
  const float* x;     // (M, K) natural order
  const float* xsum;  // (M, K / G) in-order sum of x per group (only read when minv)
  float* out;         // (M, N)
};

// One instruction-set path: computes output columns n0..n1 for all M rows.
struct IsaOps {
  const char* name;
  void (*qmm_q8)(const QmmArgs& a, int64_t n0, int64_t n1);   // int8 activations (q8_supported)
  void (*qmm_f32)(const QmmArgs& a, int64_t n0, int64_t n1);  // fp32 activations
  // the per-call work around the matmul, on this path's vectors; the same bits as the references
  // quantize_act (qmm_ref.cpp), silu_mul and attend_groups (layers.cpp), which the scalar path uses
  void (*quantize_act)(const float* x, int64_t M, int64_t K, int64_t G, int64_t bits, int8_t* q, float* lane,
                       int32_t* bias, float* gs);
  void (*silu_mul)(const float* gate, const float* up, int64_t n, float* out);  // n elements of one row
  void (*attend_groups)(const float* qkv, const float* kc, const float* vc, const int64_t* start, int64_t B,
                        int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t cap, int64_t hc, int64_t tc,
                        float* out, int64_t i0, int64_t i1, float* scratch, const int64_t* vis, const int64_t* nvis);
  // the K-quant rule (kquant.h) over tiles t0..t1 of 16 columns, and its activations (act_q8k's bits)
  void (*qmm_k)(const KqArgs& a, int64_t t0, int64_t t1);
  void (*act_k)(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* b16n, int32_t* b32, uint8_t* e);
  // the block formats' activations (kquant.h BLOCK FORMATS: act_q8b's bits)
  void (*act_b)(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* bsum);
  // the AMX path only (else null): whether its qmm_k runs an M-row call of format fmt on the tiles, and the
  // tiles' activation bytes of such a call (ActQ8K::alo / ahi from q and e, rows 0..M-1), split once per call
  bool (*tiles_for)(int64_t M, int fmt) = nullptr;
  void (*act_split)(const int8_t* q, const uint8_t* e, int64_t M, int64_t K, int8_t* lo, int8_t* hi) = nullptr;
};

// int8 activations apply when the code rows split into whole 32-byte half steps
inline bool q8_supported(int64_t bits, int64_t K, int64_t G) {
  return (bits == 4 && K % 64 == 0 && G == 32) || (bits == 8 && K % 32 == 0 && (G == 16 || G == 32));
}

inline int64_t nsteps(int64_t K, int64_t bits) { return (K * bits / 8 + STEP_BYTES - 1) / STEP_BYTES; }

// natural activation index k -> its position in the quantized row (kernel order)
inline int64_t act_position(int64_t k, int64_t K, bool int4) {
  if (!int4) return k;
  const int64_t base = k - k % 128, w = k % 128, width = (K - base) < 128 ? (K - base) : 128;  // 128 or 64
  const int64_t g = w / 32, j = w % 32;
  return base + (j < 16 ? 16 * g + j : width / 2 + 16 * g + j - 16);
}

// the rule's fixed 16-lane sum (plain C++; each SIMD path has the same tree in registers)
inline float tree16(const float* a) {
  float b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  for (int i = 0; i < 2; ++i) d[i] = c[i] + c[i + 2];
  return d[0] + d[1];
}

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + m) - m rounds |v| < 2^22 to nearest even

// round to nearest, ties to even, for |v| < 2^22: exact, inline everywhere (std::nearbyint is a library
// call on baseline x86-64, which has no SSE4.1 roundss)
inline float round_even(float v) {
  volatile float magic = kRoundMagic;  // volatile: the compiler may not fold the two adds
  const float m = magic;
  return (v + m) - m;
}

float half_to_float(uint16_t h);  // exact IEEE binary16 -> binary32 (subnormals, inf, nan; qmm_ref.cpp)

// Sizes of the ActQ8 buffers for (M, K, G, bits)
struct ActQ8Sizes { int64_t q, lane, gs; };
ActQ8Sizes act_sizes(int64_t M, int64_t K, int64_t G, int64_t bits);
// Fill caller-provided buffers (sizes from act_sizes). The reference (plain C++); each path's
// IsaOps::quantize_act computes the same bits faster.
void quantize_act(const float* x, int64_t M, int64_t K, int64_t G, int64_t bits, int8_t* q, float* lane,
                  int32_t* bias, float* gs);
// (M, K / G) in-order group sums of x (fp32-activation offsets)
void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum);

// ---- paths (core/paths.def: one line each) ----
extern const IsaOps kScalar;  // the reference: the rule written out in plain C++ (qmm_ref.cpp)
// <name>_ops() for every path: its file under arch/ (scalar: qmm_ref.cpp); null when not compiled in
// (another architecture, an old compiler)
#define DW_PATH(name, family, cpu_check, rank) const IsaOps* name##_ops();
#include "core/paths.def"
#undef DW_PATH

// ---- dispatch (dispatch.cpp) ----
struct PathInfo {
  const char* name;
  const char* family;  // "ANY", "X86", "ARM"
  int rank;            // preference: the highest usable rank runs by default
};
int path_count();              // every path of paths.def, compiled in or not
PathInfo path_info(int i);     // in paths.def order
const char* cpu_features();    // e.g. "avx2 fma f16c" as found by cpuid / getauxval
int available_paths(const char** names, int cap);  // compiled in AND supported by this CPU, lowest rank first
const IsaOps* path_by_name(const char* name);      // null if unknown, not compiled or not supported
const IsaOps* active();                // the path set by set_active (DRAFTWISE_ISA, from Python), else the best available
// Force a path ("vnni" = the best VNNI path; "auto" = best). Returns false (and changes nothing) when
// the name is unknown or this CPU cannot run it.
bool set_active(const char* name);  // also clears the multi-row path below
// Calls with at least kMultiRows activation rows may run on another path than active(): one measured
// to be faster there (every path computes the same bits, so which one runs is a question of speed only).
constexpr int64_t kMultiRows = 3;
const IsaOps* active_for(int64_t rows);  // the multi-row path for rows >= kMultiRows when set, else active()
bool set_multi(const char* name);        // "" clears; false (nothing changed) for an unusable name
const char* multi_name();                // "" when none is set

// ---- the whole matmul on one thread range (dispatching on the active path) ----
void qmm_columns(const IsaOps* ops, const QmmArgs& a, bool q8, int64_t n0, int64_t n1);

// ---- fused layer ops (layers.cpp): portable, fixed-order, same bits everywhere ----
float dw_exp(float x);  // exp with a fixed polynomial (libm's expf differs between builds)
// dw_exp's constants, one definition for the reference and every path's vector exp (x86_act.inc exp8,
// neon_act.inc exp4): n = round_even(x * kExpLog2e); r = (x - n * kExpLn2Hi) + n * kExpLn2Lo (ln 2 split in
// two: n * kExpLn2Hi is exact); p = Horner over kExpPoly (Cephes expf minimax on |r| <= ln2 / 2);
// y = (p * (r * r) + r) + 1; y * 2^n. Above kExpHi: +inf; below kExpLo: 0 (flushed, deterministically)
constexpr float kExpHi = 88.72283f, kExpLo = -87.0f, kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
void rms_norm(const float* x, const float* w, int64_t M, int64_t D, float eps, float* out);
void silu_mul_span(const float* gate, const float* up, int64_t n, float* out);  // the reference of IsaOps::silu_mul
void silu_mul(const float* gu, int64_t M, int64_t F, float* out);  // rows of [gate | up], F each
void rope_append(float* qkv, const float* cos, const float* sin, float* kc, float* vc, const int64_t* start,
                 int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t cap);
// attention of item i in [0, B * T * nh) (row b, token t, head h) over its start[b] + t + 1 keys (causal), or,
// given vis / nvis (a token tree), over the start[b] cached keys and then the nvis[b, t] new tokens
// vis[b, t, 0..nvis-1] (indices into the T new tokens: a node's path, root first) — the keys, in the same
// order, that decoding the path one token at a time attends to, so the node's output is the same bits
void attend_items(const float* qkv, const float* kc, const float* vc, const int64_t* start, int64_t B, int64_t T,
                  int64_t nh, int64_t nkv, int64_t hd, int64_t cap, float* out, int64_t i0, int64_t i1,
                  float* scratch /* >= max keys */, const int64_t* vis = nullptr, const int64_t* nvis = nullptr);
// attend_items for the hc consecutive query heads of tokens tk * tc .. tk * tc + tc - 1 (fewer in the last
// chunk) of each group i in [i0, i1) of attend_groups_count (row b = i / (nt * nh / hc) with nt = ceil(T / tc),
// token chunk tk = (i / (nh / hc)) % nt, heads (i % (nh / hc)) * hc ..): the unit the paths parallelize over,
// hc a divisor of nh / nkv so that a group's queries share one KV head (the reference of
// IsaOps::attend_groups; attend_split picks hc and tc). scratch: >= attend_scratch(hc, tc, max keys) floats
void attend_groups(const float* qkv, const float* kc, const float* vc, const int64_t* start, int64_t B, int64_t T,
                   int64_t nh, int64_t nkv, int64_t hd, int64_t cap, int64_t hc, int64_t tc, float* out, int64_t i0,
                   int64_t i1, float* scratch, const int64_t* vis = nullptr, const int64_t* nvis = nullptr);
inline int64_t attend_groups_count(int64_t B, int64_t T, int64_t nh, int64_t hc, int64_t tc) {
  return B * ((T + tc - 1) / tc) * (nh / hc);
}
inline int64_t attend_scratch(int64_t hc, int64_t tc, int64_t keys) { return hc * tc * (keys + 1); }  // scores, 1 / sums
// hc and tc for attend_groups: the most heads per group, then the most tokens (the fewest reads of each key
// block: a group's queries share them), that still give `threads` threads an even share of groups, or at
// least 4 groups each
void attend_split(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t threads, int64_t* hc, int64_t* tc);
// (N, K) bf16 bits of w = scale * q - minv (rounded to nearest even), rows n0..n1
void dequantize_bf16_rows(const uint8_t* q, const float* scale, const float* minv, int64_t K, int64_t G,
                          int64_t bits, uint16_t* out, int64_t n0, int64_t n1);

}  // namespace dw
