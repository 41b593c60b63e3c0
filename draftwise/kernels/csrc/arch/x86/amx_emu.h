// An emulation of the AMX tile instructions the K-quant tile kernel uses (kquant_amx.inc), in plain C++ for
// every CPU, with the semantics of the Intel SDM (vol. 2, LDTILECFG, TILELOADD, TILESTORED, TILEZERO,
// TDPBSSD/TDPBSUD/TDPBUSD/TDPBUUD, TILERELEASE):
//   - eight tile registers of 16 rows x 64 bytes per thread; ldtilecfg (palette 1) gives tile i rows[i]
//     rows of colsb[i] bytes and zeroes every tile; a tile with rows or colsb 0 is unconfigured;
//   - tileloadd copies rows[i] rows of colsb[i] bytes from base + r * stride and zeroes the rest of the
//     register; tilestored writes rows[i] rows of colsb[i] bytes;
//   - tdpb<a><b>d c, a, b: for m < rows(c), n < colsb(c) / 4: c[m][n] (int32) += sum over
//     k < colsb(a) / 4 of the 4-byte dot product of a's bytes 4k..4k+3 of row m (signed when <a> = s) with
//     b's bytes 4n..4n+3 of row k (signed when <b> = s), each dot product added in int32 with wrap-around;
//     the bytes of c past its rows x colsb are zeroed. The shapes must agree: rows(a) = rows(c),
//     colsb(b) = colsb(c), colsb(a) = 4 rows(b), three different registers;
//   - what would raise #UD / #GP on the hardware (an instruction before ldtilecfg, an unconfigured tile,
//     shapes that disagree, a bad configuration) throws std::runtime_error here, so a test sees it.
// With EmuLanes (16 int32 / float lanes, the float steps as single IEEE operations: std::fma is one
// rounding) the emulated kernel computes, step for step, what the hardware one computes on AVX-512.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "arch/x86/amx.h"
#include "core/qmm.h"  // half_to_float

namespace dw {
namespace amx_emu {

struct State {
  bool configured = false;
  AmxTileCfg cfg;
  uint8_t t[8][16][64];
};
inline State& state() {
  static thread_local State s;
  return s;
}

[[noreturn]] inline void fault(const std::string& what) { throw std::runtime_error("emulated AMX: " + what); }

inline void need(int i, const char* op) {
  const State& s = state();
  if (!s.configured) fault(std::string(op) + " before ldtilecfg");
  if (s.cfg.rows[i] == 0) fault(std::string(op) + " on unconfigured tmm" + std::to_string(i));
}

}  // namespace amx_emu

struct EmuTiles {
  static void config(const AmxTileCfg& c) {
    amx_emu::State& s = amx_emu::state();
    if (c.palette == 0) {  // palette 0: back to the initial state
      s = amx_emu::State();
      return;
    }
    if (c.palette != 1 || c.start_row != 0) amx_emu::fault("ldtilecfg: palette must be 1, start_row 0");
    for (uint8_t r : c.reserved)
      if (r) amx_emu::fault("ldtilecfg: reserved bytes must be zero");
    for (int i = 0; i < 16; ++i) {
      const bool unused = c.rows[i] == 0 && c.colsb[i] == 0;
      if (i >= 8 ? !unused : (!unused && (c.rows[i] == 0 || c.colsb[i] == 0 || c.rows[i] > 16 || c.colsb[i] > 64)))
        amx_emu::fault("ldtilecfg: tile " + std::to_string(i) + " has " + std::to_string(c.rows[i]) + " rows of " +
                       std::to_string(c.colsb[i]) + " bytes");
    }
    s.cfg = c;
    s.configured = true;
    std::memset(s.t, 0, sizeof(s.t));
  }
  static void release() { amx_emu::state() = amx_emu::State(); }
  template <int T>
  static void zero() {
    amx_emu::need(T, "tilezero");
    std::memset(amx_emu::state().t[T], 0, sizeof(amx_emu::state().t[T]));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    amx_emu::need(T, "tileloadd");
    amx_emu::State& s = amx_emu::state();
    std::memset(s.t[T], 0, sizeof(s.t[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(s.t[T][r], (const uint8_t*)base + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    amx_emu::need(T, "tilestored");
    const amx_emu::State& s = amx_emu::state();
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy((uint8_t*)base + r * stride, s.t[T][r], s.cfg.colsb[T]);
  }
  template <bool SA, bool SB, int C, int A, int B>
  static void dp() {
    static_assert(C != A && C != B && A != B && C < 8 && A < 8 && B < 8, "tdpb*d: three different tile registers");
    amx_emu::need(C, "tdpb*d"), amx_emu::need(A, "tdpb*d"), amx_emu::need(B, "tdpb*d");
    amx_emu::State& s = amx_emu::state();
    const AmxTileCfg& c = s.cfg;
    if (c.rows[C] != c.rows[A] || c.colsb[C] != c.colsb[B] || c.colsb[A] != 4 * c.rows[B] || c.colsb[C] % 4 != 0)
      amx_emu::fault("tdpb*d: shapes disagree (c " + std::to_string(c.rows[C]) + "x" + std::to_string(c.colsb[C]) +
                     ", a " + std::to_string(c.rows[A]) + "x" + std::to_string(c.colsb[A]) + ", b " +
                     std::to_string(c.rows[B]) + "x" + std::to_string(c.colsb[B]) + ")");
    for (int m = 0; m < c.rows[C]; ++m) {
      for (int n = 0; n < c.colsb[C] / 4; ++n) {
        uint32_t acc;
        std::memcpy(&acc, &s.t[C][m][4 * n], 4);
        for (int k = 0; k < c.colsb[A] / 4; ++k) {
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i) {
            const uint8_t ab = s.t[A][m][4 * k + i], bb = s.t[B][k][4 * n + i];
            dot += (SA ? (int32_t)(int8_t)ab : (int32_t)ab) * (SB ? (int32_t)(int8_t)bb : (int32_t)bb);
          }
          acc += (uint32_t)dot;  // int32 with wrap-around
        }
        std::memcpy(&s.t[C][m][4 * n], &acc, 4);
      }
      std::memset(&s.t[C][m][c.colsb[C]], 0, 64 - c.colsb[C]);
    }
    for (int m = c.rows[C]; m < 16; ++m) std::memset(s.t[C][m], 0, 64);
  }
  template <int C, int A, int B>
  static void dp_su() { dp<true, false, C, A, B>(); }  // tdpbsud: a signed, b unsigned
  template <int C, int A, int B>
  static void dp_ss() { dp<true, true, C, A, B>(); }  // tdpbssd: both signed
};

// 16 lanes of int32 / float with the operations of the AVX-512 lanes of qmm_amx.cpp, one IEEE operation each
struct EmuLanes {
  struct I { int32_t v[16]; };
  struct F { float v[16]; };
  static I iload(const int32_t* p) { I r; std::memcpy(r.v, p, 64); return r; }
  static I u8to32(const uint8_t* p) { I r; for (int l = 0; l < 16; ++l) r.v[l] = p[l]; return r; }
  static I i8to32(const uint8_t* p) { I r; for (int l = 0; l < 16; ++l) r.v[l] = (int8_t)p[l]; return r; }
  static I set32(int32_t v) { I r; for (int l = 0; l < 16; ++l) r.v[l] = v; return r; }
  static I izero() { return set32(0); }
  static I add(I a, I b) { for (int l = 0; l < 16; ++l) a.v[l] = (int32_t)((uint32_t)a.v[l] + (uint32_t)b.v[l]); return a; }
  static I mul(I a, I b) { for (int l = 0; l < 16; ++l) a.v[l] = (int32_t)((uint32_t)a.v[l] * (uint32_t)b.v[l]); return a; }
  static I sllv(I a, I n) { for (int l = 0; l < 16; ++l) a.v[l] = (int32_t)((uint32_t)a.v[l] << n.v[l]); return a; }
  static I dpwssd(I acc, I a, I b) {  // vpdpwssd: + lo16(a) * lo16(b) + hi16(a) * hi16(b), int32 with wrap-around
    for (int l = 0; l < 16; ++l) {
      const int32_t p = (int32_t)(int16_t)(a.v[l] & 0xFFFF) * (int16_t)(b.v[l] & 0xFFFF) +
                        (int32_t)(int16_t)((uint32_t)a.v[l] >> 16) * (int16_t)((uint32_t)b.v[l] >> 16);
      acc.v[l] = (int32_t)((uint32_t)acc.v[l] + (uint32_t)p);
    }
    return acc;
  }
  static F cvt(I a) { F r; for (int l = 0; l < 16; ++l) r.v[l] = (float)a.v[l]; return r; }
  static F h2f(const uint8_t* p) {
    F r;
    for (int l = 0; l < 16; ++l) r.v[l] = half_to_float((uint16_t)(p[2 * l] | (p[2 * l + 1] << 8)));
    return r;
  }
  static F fset(float v) { F r; for (int l = 0; l < 16; ++l) r.v[l] = v; return r; }
  static F fzero() { return fset(0.f); }
  static F fload(const float* p) { F r; std::memcpy(r.v, p, 64); return r; }
  static void fstore(float* p, F a) { std::memcpy(p, a.v, 64); }
  static F fmul(F a, F b) { for (int l = 0; l < 16; ++l) a.v[l] = a.v[l] * b.v[l]; return a; }
  static F fma(F a, F b, F c) { for (int l = 0; l < 16; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]); return c; }
  static F fnma(F a, F b, F c) { for (int l = 0; l < 16; ++l) c.v[l] = std::fma(a.v[l], -b.v[l], c.v[l]); return c; }
};

struct EmuOps : EmuTiles, EmuLanes {};

}  // namespace dw
