// AVX-512 (F, BW, DQ, VL) path without VNNI (Intel Skylake-SP / Cascade Lake without VNNI use, AMD Zen 4
// when forced). The kernel is x86_512.h.
#include "core/qmm.h"
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")
#define DW_VNNI 0
#include "arch/x86/x86_512.h"
#pragma GCC pop_options
namespace dw {
const IsaOps* avx512_ops() {
  static const IsaOps ops = {"avx512", qmm_q8, qmm_f32, quantize_act_x86, silu_mul_x86, attend_groups_simd, kq_qmm, act_q8k_x86, act_q8b_x86};
  return &ops;
}
}  // namespace dw
#else
namespace dw { const IsaOps* avx512_ops() { return nullptr; } }
#endif
