// GGUF Q4_K / Q6_K rows -> the K-quant rule's x16 layout (core/kquant.h), at load time: the file's own
// bytes re-laid out 16 columns to a tile, the packed 6-bit scales unpacked, nothing re-quantized.
#include <cstring>

#include "core/kquant.h"
#include "gguf/repack.h"

namespace dw {

void kq_pack_rows(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK, tile = kq_tile_bytes(fmt), gbytes = fmt == kKq4 ? 144 : 210;
  for (int64_t n = n0; n < n1; ++n) {
    const int c = (int)(n % KQ_COLS);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* g = src + (n * nb + b) * gbytes;
      uint8_t* blk = dst + ((n / KQ_COLS) * nb + b) * tile;
      if (fmt == kKq4) {
        // GGUF block_q4_K: d, dmin (fp16), scales[12] (6-bit sc / m packed), qs[128]
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
      } else {
        // GGUF block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16)
        for (int gi = 0; gi < 32; ++gi) std::memcpy(blk + KQ6_QL + (gi * 16 + c) * 4, g + 4 * gi, 4);
        for (int gi = 0; gi < 16; ++gi) std::memcpy(blk + KQ6_QH + (gi * 16 + c) * 4, g + 128 + 4 * gi, 4);
        for (int j = 0; j < 16; ++j) blk[KQ6_SC + 16 * j + c] = g[192 + j];
        std::memcpy(blk + KQ6_D + 2 * c, g + 208, 2);
      }
    }
    // the tile holding the last column zeroes its padding columns (and Q6_K's pad bytes)
    if (n == N - 1 || (fmt == kKq6 && c == KQ_COLS - 1)) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = dst + ((n / KQ_COLS) * nb + b) * tile;
        if (fmt == kKq6) std::memset(blk + KQ6_D + 32, 0, tile - KQ6_D - 32);
        for (int pc = c + 1; pc < KQ_COLS && n == N - 1; ++pc) {
          if (fmt == kKq4) {
            for (int gi = 0; gi < 32; ++gi) std::memset(blk + KQ4_QS + (gi * 16 + pc) * 4, 0, 4);
            for (int j = 0; j < 8; ++j) blk[KQ4_SC + 16 * j + pc] = blk[KQ4_M + 16 * j + pc] = 0;
            std::memset(blk + KQ4_D + 2 * pc, 0, 2);
            std::memset(blk + KQ4_DMIN + 2 * pc, 0, 2);
          } else {
            for (int gi = 0; gi < 32; ++gi) std::memset(blk + KQ6_QL + (gi * 16 + pc) * 4, 0, 4);
            for (int gi = 0; gi < 16; ++gi) std::memset(blk + KQ6_QH + (gi * 16 + pc) * 4, 0, 4);
            for (int j = 0; j < 16; ++j) blk[KQ6_SC + 16 * j + pc] = 0;
            std::memset(blk + KQ6_D + 2 * pc, 0, 2);
          }
        }
      }
    }
  }
}

}  // namespace dw
