// AVX512-VNNI path: vpdpbusd on zmm (Intel Cascade Lake and later Xeons, Ice Lake, Sapphire Rapids;
// AMD Zen 4 / 5). The kernel is x86_512.h.
#include "core/qmm.h"
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#define DW_VNNI 1
#include "arch/x86/x86_512.h"
#pragma GCC pop_options
namespace dw {
const IsaOps* avx512vnni_ops() {
  static const IsaOps ops = {"avx512vnni", qmm_q8, qmm_f32, quantize_act_x86, silu_mul_x86, attend_groups_simd, kq_qmm, act_q8k_x86, act_q8b_x86};
  return &ops;
}
}  // namespace dw
#else
namespace dw { const IsaOps* avx512vnni_ops() { return nullptr; } }
#endif
