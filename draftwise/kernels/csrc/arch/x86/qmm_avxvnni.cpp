// AVX-VNNI path: vpdpbusd on 256-bit registers (Intel Alder Lake and later client CPUs, Sapphire Rapids;
// AMD Zen 5). Same kernel as AVX2 (x86_256.h) with the two integer multiplies replaced by one dpbusd.
#include "core/qmm.h"
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__clang__) || __GNUC__ >= 11)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define DW_VNNI 1
#include "arch/x86/x86_256.h"
#pragma GCC pop_options
namespace dw {
const IsaOps* avxvnni_ops() {
  static const IsaOps ops = {"avxvnni", qmm_q8, qmm_f32, quantize_act_x86, silu_mul_x86, attend_groups_simd, kq_qmm, act_q8k_x86, act_q8b_x86};
  return &ops;
}
}  // namespace dw
#else
namespace dw { const IsaOps* avxvnni_ops() { return nullptr; } }
#endif
