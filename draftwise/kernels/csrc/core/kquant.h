// The K-quant rule: Q4_K and Q6_K weights computed from the GGUF's own integers, with the sub-block
// scales applied in integer arithmetic and one float step per super-block of 256 (the formats of a
// Q4_K_M / Q5_K_M / Q6_K file's large matrices); and its block-of-32 sibling for Q4_0, Q4_1, Q5_0 and
// Q8_0 (BLOCK FORMATS below: one integer dot product and one float step per block of 32). Other formats
// (and fp32 activations) keep the rule of qmm.h.
//
// LAYOUT ("x16": 16 output columns interleaved, the GGUF's bytes re-laid out at load, never re-quantized)
//   A tensor (N, K) is cut into tiles of 16 consecutive output columns (rows of W; the last tile padded
//   with zero columns) and each tile into K / 256 super-blocks; tile t's super-block b lives at
//   (t * (K / 256) + b) * TILE bytes. Inside, every array is [item][column], 16 columns per item:
//   Q4_K (KQ4_TILE = 2368 bytes):
//     qs  [32][16][4]  u8   group g of a column = its GGUF qs bytes 4g..4g+3 (low nibble of qs byte i =
//                            weight 64 (i / 32) + i % 32, high nibble = that + 32)
//     sc  [8][16]      u8   the 6-bit sub-block scales, unpacked
//     m   [8][16]      u8   the 6-bit sub-block mins, unpacked
//     d   [16]         fp16 dmin [16] fp16
//   Q6_K (KQ6_TILE = 3392 bytes, 32 of them padding so that every block starts on 64 bytes):
//     ql  [32][16][4]  u8   GGUF ql bytes 4g..4g+3      qh [16][16][4] u8   GGUF qh bytes 4g..4g+3
//     sc  [16][16]     i8   the 8-bit sub-block scales  d  [16]        fp16
//   Bytes per column and super-block: Q4_K 148 (GGUF: 144; the packed 6-bit scales are unpacked),
//   Q6_K 212 (GGUF: 210).
//
// ACTIVATIONS (act_q8k): each row is quantized in super-blocks of 256 with one scale, refined per block of 32
//   by a power of two (llama.cpp's Q8_K has the one scale only; outlier channels then leave the other
//   blocks a few codes: the refinement gives them up to 3 more bits, in integer arithmetic):
//     amax = max |x| over the 256, inv = 127 / amax (0 where amax = 0);
//     for each block j of 32: a_j = max |x| over it, s_j = the largest s in 0..3 with a_j * 2^s <= amax
//       (exact: scaling by 2^s is exact), e_j = 3 - s_j (the block's products' left shift, act.e);
//       qx = round_even(x * (inv * 2^s_j)), |qx| <= 127 (the product rounds once, monotonically);
//     dx = (amax / 127) * 0.125 (act.d: the value of one code of a block with e_j = 0, i.e. shifted by 3).
//   So x ~= qx * 2^e_j * dx. With the codes: b16n[j] = -32 * (sum of qx over values 16j..16j+15), and
//   b32[j] = (sum of qx over 32j..32j+31) << e_j.
//
// THE RULE (bit-identical on every path and for any number of rows; integer sums are exact in any order):
//   For each (row, column), acc = 0, then for each super-block b in k order:
//   Q4_K: S  = sum_j sc_j * ((sum over sub-block j (32 weights) of q_k * qx_k) << e_j)  (int32, exact)
//         Mn = sum_j m_j * b32_j   (int32, exact; the tiles take j in pairs: int16 pair dot products, b32p)
//         acc = fma(float(S), d * dx, acc); acc = fma(float(Mn), -(dmin * dx), acc)
//   Q6_K: u_k = q_k + 32 in [0, 63] (the file's 6-bit code); sub-block j (16 weights) lies in block j / 2:
//         S  = sum_j sc_j * ((sum over sub-block j of u_k * qx_k + b16n_j) << e_{j/2})  (int32, exact)
//         acc = fma(float(S), d * dx, acc)
//   out = acc. (d, dmin: fp16 -> fp32 exactly; d * dx one rounding; float(int32) rounds to nearest even.)
//   No float operation depends on how the columns or rows are grouped into registers, so every path
//   keeps the 16 columns of a tile in vector lanes and computes exactly these scalar chains.
// Ranges: |S| < 2^31 (Q4_K: 8 * 63 * 32 * 15 * 127 * 8 < 2^28; Q6_K: 16 * 128 * 16 * 32 * 127 * 8 < 2^30.1),
//   |Mn| < 2^24: no overflow.
// BLOCK FORMATS (Q4_0, Q4_1, Q5_0, Q8_0: a fp16 scale per block of 32 weights; the shapes of small models,
//   whose K is often not a multiple of 256, e.g. Qwen2.5-0.5B's 896, where a Q4_K_M file falls back to
//   Q5_0 / Q8_0). The same x16 tiles, one "block" = 32 values, so tile t holds K / 32 blocks, laid out as
//   regions (each 64-byte aligned: the weight loads never straddle cache lines), [block][item][column]:
//     qs  [K/32][g][16][4] u8  column c's GGUF qs bytes 4g..4g+3 (g < 4; Q8_0: g < 8, the int8 codes)
//     qh  [K/32][16][4]    u8  Q5_0 only: column c's 32 fifth bits, re-ordered so that byte i holds
//                              bit g = the fifth bit of value 4g + i, bit 4 + g = that of value 16 + 4g + i
//                              (the values of byte i of qs group g), g = 0..3
//     d   [K/32][16]       fp16   m [K/32][16] fp16 (Q4_1 only)
//   Bytes per column and block: Q4_0 18, Q4_1 20, Q5_0 22, Q8_0 34: exactly the GGUF's.
//   Activations (act_q8b): per row and block of 32, amax = max |x|, qx = round_even(x * (127 / amax)) (0
//   where amax = 0), dx = amax / 127 (act.d, (M, K / 32)), bsum = sum of qx (act.b32, not shifted).
//   THE RULE: per (row, column), acc = 0, then per block b in k order, with u the file's unsigned code
//   (Q4_0 / Q4_1: 0..15, Q5_0: 0..31) or Q8_0's signed q:
//     I = sum over the block of u * qx  (Q8_0: q * qx), minus 8 * bsum (Q4_0) / 16 * bsum (Q5_0)  (int32, exact)
//     acc = fma(float(I), d * dx, acc); Q4_1 also acc = fma(float(bsum), m * dx, acc)
//   out = acc. (|I| < 2^20.)
#pragma once
#include <cstddef>
#include <cstdint>

namespace dw {

constexpr int64_t QK = 256;        // values per super-block
constexpr int64_t KQ_COLS = 16;    // columns per tile
constexpr int64_t KQ4_TILE = 2368;
constexpr int64_t KQ6_TILE = 3392;
// offsets inside one tile super-block
constexpr int64_t KQ4_QS = 0, KQ4_SC = 2048, KQ4_M = 2176, KQ4_D = 2304, KQ4_DMIN = 2336;
constexpr int64_t KQ6_QL = 0, KQ6_QH = 2048, KQ6_SC = 3072, KQ6_D = 3328;

// the format ids (Python passes them; QLinear's ``bits``): the ggml type id for the K-quants, 100 + the ggml
// type id for the block formats
enum KqFormat : int { kKq4 = 12, kKq6 = 14, kKb40 = 102, kKb41 = 103, kKb50 = 106, kKb80 = 108 };

constexpr int64_t KB = 32;  // values per block of the block formats
inline bool kq_is_block(int fmt) { return fmt == kKb40 || fmt == kKb41 || fmt == kKb50 || fmt == kKb80; }
inline bool kq_valid(int fmt) { return fmt == kKq4 || fmt == kKq6 || kq_is_block(fmt); }
// Where the vector kernels prefetch a format's codes: the core's first-level cache (the default) or, where
// the format's bit is set, the second (L2). A hint: it moves speed, never a bit. On AMD Zen 4 Q6_K's codes
// (three streams per super-block) streamed at ~19 GB/s prefetched into L1 and ~27 into L2, Q5_0's and Q8_0's
// 1.1-1.4x faster into L2 too; set per machine and format from a measurement (kernels._tune_prefetch).
inline int kq_format_bit(int fmt) {
  switch (fmt) {
    case kKq4: return 0;
    case kKq6: return 1;
    case kKb40: return 2;
    case kKb41: return 3;
    case kKb50: return 4;
    default: return 5;
  }
}
bool kq_prefetch_l2(int fmt);
void kq_set_prefetch_l2(int fmt, bool l2);
// Which loop Q6_K's calls of several rows take where the path has two (kquant_tiles.inc): kq6_tile_many (passes of
// KQ6_MB rows, each decoded code vector feeding them all; the default) or kq6_tile_few (up to KQ6_FEW1 rows in one
// pass, more in passes of 4). Speed only, the same bits. AMD Zen 4 ran the 1.5B's 8-row pass 18 % faster with the
// first, AMD Zen 5 11 % faster with the second (2026-11-29): set per machine from a measurement (kernels._tune_kq6).
// Since the dot products read their activation bytes themselves (2026-11-29), AMD Zen 5 runs the 1.5B's calls
// fastest with neither loop alone: the few-rows loop ran 6-row calls 6-11 % faster (its one pass) and the output head
// (K = 1536) at 7-8 rows 11 %, the many-rows loop ffn_down (K = 8960, tiles of 119 KB, which the few-rows loop's
// passes of 4 re-read from L2) at 7-8 rows 13 % and the head at 16-32 rows 5-7 %. So the choice is per call shape,
// one bit each of kq6_shape (rows up to 6, 7-8, more; K up to kKq6LongK or more), timed per machine
// (kernels._tune_kq6); kq6_many / kq6_set_many: every shape the one loop.
constexpr int64_t kKq6LongK = 4096;      // longer rows: a tile's super-blocks (K / 256 x 3392 bytes) pass 54 KB
constexpr uint32_t kKq6AllMany = 0x3F;   // every shape: the many-rows loop (the default where untimed)
inline int kq6_shape(int64_t M, int64_t K) { return 2 * (M <= 6 ? 0 : M <= 8 ? 1 : 2) + (K > kKq6LongK ? 1 : 0); }
uint32_t kq6_many_mask();
void kq6_set_many_mask(uint32_t mask);
inline bool kq6_many_at(int64_t M, int64_t K) { return (kq6_many_mask() >> kq6_shape(M, K)) & 1u; }
bool kq6_many();
void kq6_set_many(bool many);
inline int64_t kq_block_values(int fmt) { return kq_is_block(fmt) ? KB : QK; }
// GGUF bytes of one block (= one column's bytes per tile block)
inline int64_t kq_gguf_block(int fmt) {
  switch (fmt) {
    case kKq4: return 144;
    case kKq6: return 210;
    case kKb40: return 18;
    case kKb41: return 20;
    case kKb50: return 22;
    default: return 34;
  }
}
// bytes of one tile (16 columns) per block: 16 * kq_gguf_block but for the K-quants' unpacked scales
inline int64_t kq_tile_bytes(int fmt) { return fmt == kKq4 ? KQ4_TILE : fmt == kKq6 ? KQ6_TILE : 16 * kq_gguf_block(fmt); }
inline int64_t kq_tiles(int64_t N) { return (N + KQ_COLS - 1) / KQ_COLS; }
inline int64_t kq_bytes(int fmt, int64_t N, int64_t K) {
  return kq_tiles(N) * (K / kq_block_values(fmt)) * kq_tile_bytes(fmt);
}
// a block format's code offset (the file's u minus this is the value: Q4_0 8, Q5_0 16, else 0), and where its
// qs bytes start in the GGUF block (after d, Q4_1's m, Q5_0's qh)
constexpr int kb_code_offset(int fmt) { return fmt == kKb40 ? 8 : fmt == kKb50 ? 16 : 0; }
constexpr int kb_gguf_qs(int fmt) { return fmt == kKb41 ? 4 : fmt == kKb50 ? 6 : 2; }
// the regions of a block format's tile of nb blocks: byte offsets of qs, qh, d and m (qh / m: -1 if none);
// qs_block: the qs bytes of one block (16 columns x 16 or 32 bytes, 64 per 4-byte group)
struct KbRegions { int64_t qs, qh, d, m, qs_block; };
inline KbRegions kb_regions(int fmt, int64_t nb) {
  const int64_t qsb = fmt == kKb80 ? 512 : 256, qh = fmt == kKb50 ? nb * qsb : -1;
  const int64_t d = nb * qsb + (fmt == kKb50 ? nb * 64 : 0);
  return {0, qh, d, fmt == kKb41 ? d + nb * 32 : -1, qsb};
}

// One call's quantized activations, M rows (built by act_q8k; for the block formats by act_q8b: q, d
// (M, K / 32) and b32 (the plain sums), b16n / e unused)
struct ActQ8K {
  const int8_t* q;      // (M, K) natural order
  const float* d;       // (M, K / 256)
  const int32_t* b16n;  // (M, K / 16) -32 * sums over 16
  const int32_t* b32;   // (M, K / 32) sums over 32, shifted left by e
  const uint8_t* e;     // (M, K / 32) left shift (0..3) of each block of 32's products
  // the same integers as the tiles read them (kq_act_lanes; K-quants only, else null): a 32-bit word a
  // vector broadcasts straight from memory
  const int32_t* e32;   // (M, K / 32) e, as int32
  const int32_t* b32p;  // (M, K / 64) b32 in int16 pairs: word k = b32[2k] (low half) | b32[2k + 1] << 16
  // the AMX tiles' activation bytes (arch/x86/kquant_amx.inc: v = q << e = alo + 128 * ahi), where the call's
  // path splits them once (IsaOps::act_split); null elsewhere (the tile kernel then splits them itself)
  const int8_t* alo = nullptr;  // (M, K) v & 127
  const int8_t* ahi = nullptr;  // (M, K) v >> 7
};

// e32 and b32p of ActQ8K from e and b32, rows m0..m1 (exact: |b32| <= 32 * 127 * 8 = 32512 fits int16)
void kq_act_lanes(int64_t m0, int64_t m1, int64_t K, const int32_t* b32, const uint8_t* e, int32_t* e32, int32_t* b32p);

struct KqArgs {
  int64_t M, K, N;
  int fmt;
  const uint8_t* w;  // kq_bytes(fmt, N, K)
  ActQ8K act;
  float* out;        // (M, N)
};

// s_j of ACTIVATIONS above: the doublings (0..3) of a block of 32 whose max |x| is a, in a super-block whose
// max is amax (exact: scaling by 2^s is exact); its products' shift is e_j = 3 - s_j. Every act_k uses this.
inline int kq_doublings(float a, float amax) {
  int s = 0;
  while (s < 3 && a * (float)(2 << s) <= amax) ++s;  // a * 2^(s+1) <= amax: one more doubling
  return s;
}

// the block formats' activations (BLOCK FORMATS above); each path's IsaOps::act_b computes the same bits
void act_q8b(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* bsum);
// the reference quantization (every path uses it: the same bits everywhere)
void act_q8k(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* b16n, int32_t* b32, uint8_t* e);
// the reference product for tiles t0..t1 (the rule written out one column at a time)
void kq_ref(const KqArgs& a, int64_t t0, int64_t t1);
// (GGUF rows -> this layout: kq_pack_rows, gguf/repack.h)
// x16 layout -> fp32 weights w = d * sc * q - dmin * m (Q4_K) / d * sc * (u - 32) (Q6_K) / d * (u - 8)
// (Q4_0) / d * u + m (Q4_1) / d * (u - 16) (Q5_0) / d * q (Q8_0) of rows n0..n1,
// row n at out + (n - n0) * K, every product rounded as written (reference de-quantization, embedding
// lookups, de-quantized prefill, tests)
void kq_dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, float* out, int64_t n0, int64_t n1);

}  // namespace dw
