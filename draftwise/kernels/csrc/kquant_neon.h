// The K-quant rule's vector operations on AArch64 NEON (KV: 4 columns per int32x4 / float32x4 register, a
// tile in four slots), included by neon.h inside its anonymous namespace, DW_DOT set (vdotq_s32: the
// dot-product extension). Weight codes (0..63) fit int8, so the signed dot products are the rule's.
// The kernel itself is kquant_tiles.h.
#include "kquant.h"

#define KQ_DOT DW_DOT

struct KV {
  using I = int32x4_t;
  using F = float32x4_t;
  static constexpr int W = 4;
  static I load(const uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }
  static I and_(I a, I b) { return vandq_s32(a, b); }
  static I or_(I a, I b) { return vorrq_s32(a, b); }
  static I srl16(I a, int n) { return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a), vdupq_n_s16((int16_t)-n))); }
  static I sll16(I a, int n) { return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a), vdupq_n_s16((int16_t)n))); }
  static I set8(int v) { return vreinterpretq_s32_u8(vdupq_n_u8((uint8_t)v)); }
  static I set32(int32_t v) { return vdupq_n_s32(v); }
  static I zero() { return vdupq_n_s32(0); }
  static I add(I a, I b) { return vaddq_s32(a, b); }
  static I mul(I a, I b) { return vmulq_s32(a, b); }
  static I u8to32(const uint8_t* p) {
    uint8_t t[8] = {p[0], p[1], p[2], p[3], 0, 0, 0, 0};
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(t)))));
  }
  static I i8to32(const uint8_t* p) {
    int8_t t[8] = {(int8_t)p[0], (int8_t)p[1], (int8_t)p[2], (int8_t)p[3], 0, 0, 0, 0};
    return vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(t))));
  }
  static I bcast4(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return vdupq_n_s32(v); }
  static I dot(I acc, I w, I x) {
#if DW_DOT
    return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(x));
#else
    return vaddq_s32(acc, madd(dot16(w, x), vreinterpretq_s32_s16(vdupq_n_s16(1))));
#endif
  }
  // int16 pair sums of w times x (w: codes 0..63 as int8), and int32 lanes of int16 pairs times int16 pairs
  static I dot16(I w, I x) {
    const int8x16_t a = vreinterpretq_s8_s32(w), b = vreinterpretq_s8_s32(x);
    const int16x8_t p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b)), p1 = vmull_high_s8(a, b);
    return vreinterpretq_s32_s16(vpaddq_s16(p0, p1));
  }
  static I add16(I a, I b) { return vreinterpretq_s32_s16(vaddq_s16(vreinterpretq_s16_s32(a), vreinterpretq_s16_s32(b))); }
  static I madd(I a, I b) {
    const int16x8_t x = vreinterpretq_s16_s32(a), y = vreinterpretq_s16_s32(b);
    const int32x4_t p0 = vmull_s16(vget_low_s16(x), vget_low_s16(y)), p1 = vmull_high_s16(x, y);
    return vpaddq_s32(p0, p1);
  }
  static I pair16(I a) { return vorrq_s32(a, vshlq_n_s32(a, 16)); }
  static F h2f(const uint8_t* p) {
    uint16_t t[4];
    std::memcpy(t, p, 8);
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(t)));
  }
  static F cvt(I a) { return vcvtq_f32_s32(a); }
  static F fset(float v) { return vdupq_n_f32(v); }
  static F fzero() { return vdupq_n_f32(0.f); }
  static F fmul(F a, F b) { return vmulq_f32(a, b); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F fnma(F a, F b, F c) { return vfmsq_f32(c, a, b); }  // c - a * b = fma(a, -b, c)
  static void store(float* p, F a) { vst1q_f32(p, a); }
};

constexpr int KQ_MB = 4;
inline void kq_prefetch(const uint8_t* p) { __builtin_prefetch(p + 2048); }

#include "kquant_tiles.h"  // kq_qmm
