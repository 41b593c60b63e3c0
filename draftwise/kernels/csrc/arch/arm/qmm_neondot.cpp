// ARM NEON with the dot-product extension (vdotq_s32; ARMv8.2-A+dotprod). The kernel is neon.h.
#include "core/qmm.h"
#if defined(__aarch64__)
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#define DW_DOT 1
#include "arch/arm/neon.h"
#pragma GCC pop_options
namespace dw {
const IsaOps* neondot_ops() {
  static const IsaOps ops = {"neondot", qmm_q8, qmm_f32, quantize_act_neon, silu_mul_neon, attend_groups_simd, kq_qmm, dw::act_q8k, dw::act_q8b};
  return &ops;
}
}  // namespace dw
#else
namespace dw { const IsaOps* neondot_ops() { return nullptr; } }
#endif
