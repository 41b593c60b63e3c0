// ARM NEON path without the dot-product extension (any AArch64 CPU). The kernel is neon.h.
#include "core/qmm.h"
#if defined(__aarch64__)
#define DW_DOT 0
#include "arch/arm/neon.h"
namespace dw {
const IsaOps* neon_ops() {
  static const IsaOps ops = {"neon", qmm_q8, qmm_f32, quantize_act_neon, silu_mul_neon, attend_groups_simd, kq_qmm, dw::act_q8k, dw::act_q8b};
  return &ops;
}
}  // namespace dw
#else
namespace dw { const IsaOps* neon_ops() { return nullptr; } }
#endif
