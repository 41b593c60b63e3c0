// GGUF Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 rows -> the K-quant rule's x16 layout (core/kquant.h), at load
// time: the file's own bytes re-laid out 16 columns to a tile, the packed 6-bit scales unpacked (Q5_0's fifth
// bits re-ordered), nothing re-quantized.
#include <algorithm>
#include <cstring>

#include "core/kquant.h"
#include "gguf/repack.h"

namespace dw {

namespace {

// GGUF block_q4_K (d, dmin fp16; scales[12]: 6-bit sc / m packed; qs[128]) -> column c of its tile
inline void put_q4k(const uint8_t* g, uint8_t* blk, int c) {
  std::memcpy(blk + KQ4_D + 2 * c, g, 2);
  std::memcpy(blk + KQ4_DMIN + 2 * c, g + 2, 2);
  const uint8_t* s = g + 4;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, mn;
    if (j < 4) {
      sc = s[j] & 63, mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    blk[KQ4_SC + 16 * j + c] = sc;
    blk[KQ4_M + 16 * j + c] = mn;
  }
  for (int gi = 0; gi < 32; ++gi) std::memcpy(blk + KQ4_QS + (gi * 16 + c) * 4, g + 16 + 4 * gi, 4);
}

// GGUF block_q6_K (ql[128], qh[64], scales[16] int8, d fp16) -> column c of its tile
inline void put_q6k(const uint8_t* g, uint8_t* blk, int c) {
  for (int gi = 0; gi < 32; ++gi) std::memcpy(blk + KQ6_QL + (gi * 16 + c) * 4, g + 4 * gi, 4);
  for (int gi = 0; gi < 16; ++gi) std::memcpy(blk + KQ6_QH + (gi * 16 + c) * 4, g + 128 + 4 * gi, 4);
  for (int j = 0; j < 16; ++j) blk[KQ6_SC + 16 * j + c] = g[192 + j];
  std::memcpy(blk + KQ6_D + 2 * c, g + 208, 2);
}

// GGUF block of a block format (d fp16, [m fp16,] [qh 4 bytes,] qs) -> column c of block b of its tile
inline void put_block(int fmt, const uint8_t* g, uint8_t* tile, const KbRegions& r, int64_t b, int c) {
  std::memcpy(tile + r.d + b * 32 + 2 * c, g, 2);
  if (fmt == kKb41) std::memcpy(tile + r.m + b * 32 + 2 * c, g + 2, 2);
  const uint8_t* qs = g + kb_gguf_qs(fmt);
  for (int gi = 0; gi < r.qs_block / 64; ++gi) std::memcpy(tile + r.qs + b * r.qs_block + (gi * 16 + c) * 4, qs + 4 * gi, 4);
  if (fmt == kKb50) {  // file: bit v of the 32-bit qh = the fifth bit of value v; here byte i: bits g, 4 + g
    const uint32_t qh = (uint32_t)g[2] | ((uint32_t)g[3] << 8) | ((uint32_t)g[4] << 16) | ((uint32_t)g[5] << 24);
    uint8_t* o = tile + r.qh + b * 64 + c * 4;
    for (int i = 0; i < 4; ++i) {
      uint8_t v = 0;
      for (int gi = 0; gi < 4; ++gi) v |= (uint8_t)((((qh >> (4 * gi + i)) & 1) << gi) | (((qh >> (16 + 4 * gi + i)) & 1) << (4 + gi)));
      o[i] = v;
    }
  }
}

// column c of block b of a block format's tile all zeros (a padding column)
inline void zero_block_col(int fmt, uint8_t* tile, const KbRegions& r, int64_t b, int c) {
  std::memset(tile + r.d + b * 32 + 2 * c, 0, 2);
  if (fmt == kKb41) std::memset(tile + r.m + b * 32 + 2 * c, 0, 2);
  for (int gi = 0; gi < r.qs_block / 64; ++gi) std::memset(tile + r.qs + b * r.qs_block + (gi * 16 + c) * 4, 0, 4);
  if (fmt == kKb50) std::memset(tile + r.qh + b * 64 + c * 4, 0, 4);
}

// column c of a tile all zeros (a padding column past the matrix's last row)
inline void zero_col(int fmt, uint8_t* blk, int c) {
  if (fmt == kKq4) {
    for (int gi = 0; gi < 32; ++gi) std::memset(blk + KQ4_QS + (gi * 16 + c) * 4, 0, 4);
    for (int j = 0; j < 8; ++j) blk[KQ4_SC + 16 * j + c] = blk[KQ4_M + 16 * j + c] = 0;
    std::memset(blk + KQ4_D + 2 * c, 0, 2);
    std::memset(blk + KQ4_DMIN + 2 * c, 0, 2);
  } else {
    for (int gi = 0; gi < 32; ++gi) std::memset(blk + KQ6_QL + (gi * 16 + c) * 4, 0, 4);
    for (int gi = 0; gi < 16; ++gi) std::memset(blk + KQ6_QH + (gi * 16 + c) * 4, 0, 4);
    for (int j = 0; j < 16; ++j) blk[KQ6_SC + 16 * j + c] = 0;
    std::memset(blk + KQ6_D + 2 * c, 0, 2);
  }
}

}  // namespace

// Tile by tile, and within a tile super-block by super-block: each tile (2.3-3.4 KB) is written whole while
// it sits in L1, from the 16 rows' blocks (row by row instead, a 8960-wide matrix's row touches 35 tiles,
// 80 KB, per pass). Rows n0..n1 only; the range holding the last row (N - 1) zeroes the padding columns,
// and the one holding a tile's column 15 (or the last row) Q6_K's pad bytes — so ranges may split tiles.
void kq_pack_rows(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, int64_t n0, int64_t n1) {
  const bool block = kq_is_block(fmt);
  const int64_t nb = K / kq_block_values(fmt), tile = kq_tile_bytes(fmt), gbytes = kq_gguf_block(fmt);
  const KbRegions r = block ? kb_regions(fmt, nb) : KbRegions{};  // a block format's tile regions
  for (int64_t t = n0 / KQ_COLS; t * KQ_COLS < n1; ++t) {
    const int64_t base = t * KQ_COLS, r0 = std::max(n0, base), r1 = std::min(n1, base + KQ_COLS);
    const bool last = r1 == N, pad6 = fmt == kKq6 && (r1 == base + KQ_COLS || last);
    uint8_t* first = dst + t * nb * tile;  // the tile
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = first + b * tile;  // a K-quant's super-block (the block formats address regions of the tile)
      for (int64_t n = r0; n < r1; ++n) {
        const uint8_t* g = src + (n * nb + b) * gbytes;
        const int c = (int)(n - base);
        if (block) put_block(fmt, g, first, r, b, c);
        else if (fmt == kKq4) put_q4k(g, blk, c);
        else put_q6k(g, blk, c);
      }
      for (int64_t c = N - base; last && c < KQ_COLS; ++c) {
        if (block) zero_block_col(fmt, first, r, b, (int)c);
        else zero_col(fmt, blk, (int)c);
      }
      if (pad6) std::memset(blk + KQ6_D + 32, 0, tile - KQ6_D - 32);
    }
  }
}

}  // namespace dw
