// GGUF blocks -> the kernel's code: see repack.h. Plain C++ (it runs once per load, bound by reading the
// file; the compiler vectorizes the byte loops).
#include "gguf/repack.h"

#include <cstring>

#include "core/qmm.h"  // half_to_float

namespace dw {

static inline float f16_at(const uint8_t* p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

bool repack_format(int type, RepackFormat* f) {
  switch (type) {
    case kQ4_0: *f = {32, 18, 32, 4, true}; return true;
    case kQ4_1: *f = {32, 20, 32, 4, true}; return true;
    case kQ5_0: *f = {32, 22, 32, 8, false}; return true;
    case kQ8_0: *f = {32, 34, 32, 8, false}; return true;
    case kQ4_K: *f = {256, 144, 32, 4, true}; return true;
    case kQ5_K: *f = {256, 176, 32, 8, true}; return true;
    case kQ6_K: *f = {256, 210, 16, 8, false}; return true;
    default: return false;
  }
}

// the 6-bit scale and min of sub-block j (0..7) from a Q4_K block's 12 packed bytes
static inline void k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63, *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// a Q4_K / Q5_K super-block's 8 sub-block scales d * sc and mins dmin * m (fp32 products: exact)
static inline void k_scales(const uint8_t* b, float* so, float* mo) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale_min(b + 4, j, &sc, &m);
    so[j] = d * (float)sc;
    mo[j] = dmin * (float)m;
  }
}

void repack_rows(int type, const uint8_t* src, int64_t K, uint8_t* q, float* scale, float* minv, int64_t n0,
                 int64_t n1) {
  RepackFormat f;
  if (!repack_format(type, &f)) return;
  const int64_t nb = K / f.block_values, row_bytes = nb * f.block_bytes, qrow = K * f.bits / 8, srow = K / f.group;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* b = src + n * row_bytes;
    uint8_t* qo = q + n * qrow;
    float* so = scale + n * srow;
    float* mo = minv ? minv + n * srow : nullptr;
    for (int64_t i = 0; i < nb; ++i, b += f.block_bytes) {
      switch (type) {
        case kQ4_0:
        case kQ4_1: {  // 16 bytes already hold q[j] (low) and q[j + 16] (high): the kernel's int4 layout
          const float d = f16_at(b);
          so[i] = d;
          mo[i] = type == kQ4_0 ? 8.0f * d : -f16_at(b + 2);
          std::memcpy(qo + 16 * i, b + (type == kQ4_0 ? 2 : 4), 16);
          break;
        }
        case kQ5_0: {  // 4 bytes of fifth bits (value j: bit j), then nibbles as Q4_0; q - 16
          so[i] = f16_at(b);
          const uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
          int8_t* o = (int8_t*)qo + 32 * i;
          for (int j = 0; j < 16; ++j) {
            o[j] = (int8_t)(((b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
            o[j + 16] = (int8_t)(((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
          }
          break;
        }
        case kQ8_0:
          so[i] = f16_at(b);
          std::memcpy(qo + 32 * i, b + 2, 32);
          break;
        case kQ4_K: {
          // 4 chunks of 32 bytes: chunk c's low nibbles are values 64c..64c+31 (sub-block 2c), its high
          // nibbles 64c+32.. (2c+1); the kernel wants per 32 values byte j = v[j] | v[j + 16] << 4
          const uint8_t* qs = b + 16;
          uint8_t* o = qo + 128 * i;
          for (int c = 0; c < 4; ++c) {
            const uint8_t* s = qs + 32 * c;
            for (int j = 0; j < 16; ++j) {
              o[32 * c + j] = (uint8_t)((s[j] & 0x0F) | (s[j + 16] << 4));
              o[32 * c + 16 + j] = (uint8_t)((s[j] >> 4) | (s[j + 16] & 0xF0));
            }
          }
          k_scales(b, so + 8 * i, mo + 8 * i);
          break;
        }
        case kQ5_K: {  // as Q4_K, plus qh[32]: bit s of qh[l] is the fifth bit of sub-block s's value l
          const uint8_t *qh = b + 16, *qs = b + 48;
          int8_t* o = (int8_t*)qo + 256 * i;
          for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
              o[64 * c + l] = (int8_t)((qs[32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4));
              o[64 * c + 32 + l] = (int8_t)((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
          k_scales(b, so + 8 * i, mo + 8 * i);
          break;
        }
        case kQ6_K: {
          // ql[128]: low 4 bits, qh[64]: high 2 bits, scales[16] int8, d fp16. Per half h of 128 values,
          // value 32 k + l (k = 0..3) takes ql[64h + l + 32 (k & 1)] >> 4 (k >> 1) and qh[32h + l] >> 2k
          const uint8_t *ql = b, *qh = b + 128;
          const int8_t* sc = (const int8_t*)(b + 192);
          const float d = f16_at(b + 208);
          int8_t* o = (int8_t*)qo + 256 * i;
          for (int h = 0; h < 2; ++h)
            for (int k = 0; k < 4; ++k)
              for (int l = 0; l < 32; ++l) {
                const int lo = (ql[64 * h + l + 32 * (k & 1)] >> (4 * (k >> 1))) & 0x0F;
                const int hi = (qh[32 * h + l] >> (2 * k)) & 3;
                o[128 * h + 32 * k + l] = (int8_t)((lo | (hi << 4)) - 32);
              }
          for (int g = 0; g < 16; ++g) so[16 * i + g] = d * (float)sc[g];
          break;
        }
      }
    }
  }
}

}  // namespace dw
