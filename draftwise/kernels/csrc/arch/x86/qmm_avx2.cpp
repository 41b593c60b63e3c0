// AVX2 + FMA + F16C path (Intel Haswell and later, AMD Zen 1-4). The kernel is x86_256.h.
#include "core/qmm.h"
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define DW_VNNI 0
#include "arch/x86/x86_256.h"
#pragma GCC pop_options
namespace dw {
const IsaOps* avx2_ops() {
  static const IsaOps ops = {"avx2", qmm_q8, qmm_f32, quantize_act_x86, silu_mul_x86, attend_groups_simd, kq_qmm, act_q8k_x86, act_q8b_x86};
  return &ops;
}
}  // namespace dw
#else
namespace dw { const IsaOps* avx2_ops() { return nullptr; } }
#endif
