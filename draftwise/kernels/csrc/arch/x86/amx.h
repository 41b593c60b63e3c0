// The AMX path (Intel Sapphire / Emerald / Granite Rapids Xeons): the K-quant rule (kquant.h) on AMX-INT8
// tiles for calls of 2 or more activation rows; one row stays on the AVX512-VNNI kernel (kquant_x86.h),
// which is at the memory roofline there. Every other op of the path is AVX512-VNNI's. The tile algorithm
// is kquant_amx.inc; qmm_amx.cpp instantiates it twice: on the hardware tiles, and on an emulation of the
// tile instructions in plain C++ (amx_emu.h) that runs on every CPU, so that the algorithm is tested
// (tests/selftest.cpp, tests/test_amx.py) where no AMX CPU is at hand.
//
// WHEN THE PATH RUNS (all of these, else it is absent with a recorded reason, never a crash):
//   1. the compiler knows AMX (gcc 11+ / clang 12+, x86-64; else the hardware half is not compiled);
//   2. cpuid: amx-tile, amx-int8 and AVX512-VNNI, and the OS has enabled the tile state (XCR0 bits 17, 18);
//   3. Linux grants this process the tile data: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
//   4. verified: the hardware kernel, run in a forked child (a fault there kills only the child), gives
//      the scalar reference's bits on random blocks of both formats for 1-33 rows (amx_verify). Some
//      virtual machines advertise AMX and fault on it. The verdict is cached per build, CPU and host by the
//      Python side (kernels._check_amx), which hands it back through amx_set_verdict.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dw {

struct KqArgs;

// ldtilecfg's 64-byte operand, palette 1: tile i holds rows[i] rows of colsb[i] bytes (at most 16 x 64)
struct alignas(64) AmxTileCfg {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileCfg) == 64, "ldtilecfg reads 64 bytes");

enum class AmxState : int {
  kNotBuilt,      // the compiler could not build the hardware kernel
  kNoCpu,         // cpuid / XCR0: no AMX-INT8 (or no AVX512-VNNI) here
  kNoPermission,  // Linux did not grant the tile data state (or not Linux)
  kUnchecked,     // usable hardware, not verified yet
  kVerified,      // the hardware kernel gave the reference's bits: the path is usable
  kRefused,       // the check found a difference or a fault: the path stays off
};
const char* amx_state_name(AmxState s);  // "not built", "unavailable", ..., "verified", "refused"
AmxState amx_state(std::string* reason);  // detects once (cpuid, permission request); reason: why not / verdict
bool amx_usable();                         // state == kVerified

// The bit-for-bit check in a forked child. mode 0: the hardware kernel (records the verdict: kVerified or
// kRefused, unless the hardware is absent: then nothing runs and false is returned with the reason);
// the others only report, for tests of the check itself: 1 the emulated kernel, 2 the emulated kernel with
// one output bit flipped (a difference must be refused), 3 the hardware kernel even where cpuid says
// there is no AMX (a fault must be refused). Returns true when the child's results were identical.
bool amx_verify(int mode, std::string* reason);
// a verdict found in the cache (only taken while the state is kUnchecked)
void amx_set_verdict(bool ok, const std::string& reason);

// The amx path runs a K-quant call of M rows on the tiles when M >= amx_min_rows(fmt) (Q4_K, Q6_K; else
// on AVX512-VNNI, as the block formats always): fewer rows are memory-bound there, and the tiles' fixed cost
// per super-block (the weights' B operands) is not paid back. Speed only: the same bits either way. Set per
// machine from a measurement (kernels._tune_amx); false for another format or rows < 1. Untimed: 32 rows (an
// Intel Xeon, 2026-12-07: the tiles lost at 8-24 rows, were within -5 % / +10 % of AVX512-VNNI at 32).
constexpr int kAmxMinRowsDefault = 32;
int amx_min_rows(int fmt);
bool amx_set_min_rows(int fmt, int rows);

// The tile kernel takes a call's rows in blocks of groups of 16 whose activation parts (2 K bytes a row) fit
// kAmxBlockBytes (of the 2 MB L2 every AMX Xeon has had so far), each block over all of a thread's columns in
// turn, so that a block's parts stay in L2 while the weights go by (they are read once per block): the 1.5B's
// ffn_down (K = 8960) at 128 rows has 2.3 MB of parts, read again for every 16 columns; its 14 Q4_K matrices
// took 77-80 ms in one block, 73-75 in two (Q6_K 74-75, 71-75: a few per cent; an Intel Xeon, 2026-12-07).
// amx_block_groups(K): the most groups a block holds (at least one); amx_set_block_groups(n > 0) fixes it (the
// check runs blocks of 1 and 2 groups), 0 restores it.
constexpr int64_t kAmxBlockBytes = 3 << 19;  // 1.5 MiB
int64_t amx_block_groups(int64_t K);
void amx_set_block_groups(int64_t groups);

// The hardware kernel's byte work around the tiles (the weights' B operands, the activations' two parts: plain
// AVX-512BW, no tile instruction) against the emulation's plain C++ on random blocks, so that every AVX-512
// machine tests it, not only an AMX one. "" when every byte agrees, "skipped: ..." where it cannot run, else the
// first difference.
std::string amx_bytes_check();

// the tile kernel over tiles t0..t1 for any number of rows (no 1-row hand-off), on the calling thread:
// on the emulated tiles (any CPU), or on the hardware (only when amx_usable(); returns false otherwise)
void kq_amx_emulated(const KqArgs& a, int64_t t0, int64_t t1);
bool kq_amx_hardware(const KqArgs& a, int64_t t0, int64_t t1);

}  // namespace dw
