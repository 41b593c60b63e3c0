// torch bindings of the kernel core (qmm.h): the only file that includes torch. Threads come from the
// kernel's own pool (pool.h; as many as torch's at::get_num_threads()), split over output columns, so a
// row's result never depends on the split.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "pool.h"
#include "qmm.h"
#include "repack.h"

// x: (M, K) f32; q: (N, K) int8 | (N, K/2) uint8 | (N, K) int16 / int32 views of bf16 / fp32;
// scale, minv: (N, K/G) f32 (minv may be empty). act_bits = 8: int8 activations where the format allows
// (dw::q8_supported), else fp32 activations.
torch::Tensor qmm(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor minv, int64_t G,
                  int64_t bits, int64_t act_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: (M, K) f32");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16 || bits == 32, "bits must be 4, 8, 16 (bf16) or 32 (fp32)");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat32,
              "q and scale must be contiguous, scale f32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % G == 0 && G % (bits == 4 ? 32 : 16) == 0, "bad group size");
  TORCH_CHECK(q.size(1) * q.element_size() * 8 == K * bits, "q shape does not match K");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == K / G, "scale shape");
  const bool has_min = minv.numel() > 0;
  TORCH_CHECK(!has_min || (minv.is_contiguous() && minv.scalar_type() == torch::kFloat32 && minv.numel() == scale.numel()),
              "minv shape");
  auto out = torch::empty({M, N}, x.options());
  dw::QmmArgs a{};
  a.M = M, a.K = K, a.N = N, a.G = G, a.bits = bits;
  a.q = (const uint8_t*)q.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.minv = has_min ? minv.data_ptr<float>() : nullptr;
  a.x = x.data_ptr<float>();
  a.out = out.data_ptr<float>();
  const bool q8 = act_bits == 8 && dw::q8_supported(bits, K, G);
  const dw::IsaOps* ops = dw::active_for(M);
  std::vector<int8_t> xq;
  std::vector<float> lane, gs, xsum;
  std::vector<int32_t> bias;
  if (q8) {
    const dw::ActQ8Sizes sz = dw::act_sizes(M, K, G, bits);
    xq.resize(sz.q), lane.resize(sz.lane), bias.resize(sz.lane), gs.resize(sz.gs);
    ops->quantize_act(a.x, M, K, G, bits, xq.data(), lane.data(), bias.data(), gs.data());
    a.act = {xq.data(), lane.data(), bias.data(), gs.data()};
  } else if (has_min) {
    xsum.resize(M * (K / G));
    dw::group_sums(a.x, M, K, G, xsum.data());
    a.xsum = xsum.data();
  }
  dw::parallel_for(N, 16, at::get_num_threads(), [&](int64_t n0, int64_t n1) { dw::qmm_columns(ops, a, q8, n0, n1); });
  return out;
}

torch::Tensor dequantize_bf16(torch::Tensor q, torch::Tensor scale, torch::Tensor minv, int64_t G, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "dequantize_bf16: int4 / int8 codes");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat32, "contiguous");
  const int64_t N = q.size(0), K = q.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(K % 32 == 0 && G % 16 == 0 && K % G == 0, "dequantize_bf16: group layout");
  const bool has_min = minv.numel() > 0;
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kBFloat16));
  const uint8_t* qp = (const uint8_t*)q.data_ptr();
  const float* sp = scale.data_ptr<float>();
  const float* mp = has_min ? minv.data_ptr<float>() : nullptr;
  uint16_t* op = (uint16_t*)out.data_ptr();
  dw::parallel_for(N, 64, at::get_num_threads(),
                   [&](int64_t n0, int64_t n1) { dw::dequantize_bf16_rows(qp, sp, mp, K, G, bits, op, n0, n1); });
  return out;
}

// src: the bytes of an (N, K) tensor of ggml type `type` (rows one after the other); writes its code into
// q (N, K * bits / 8), scale (N, K / G) and minv (N, K / G, or empty for formats without one): repack.h.
void repack_gguf(torch::Tensor src, int64_t type, int64_t N, int64_t K, torch::Tensor q, torch::Tensor scale,
                 torch::Tensor minv) {
  dw::RepackFormat f;
  TORCH_CHECK(dw::repack_format((int)type, &f), "repack_gguf: ggml type ", type, " is not re-packed here");
  TORCH_CHECK(K % f.block_values == 0, "repack_gguf: K is not a whole number of blocks");
  TORCH_CHECK(src.scalar_type() == torch::kUInt8 && src.is_contiguous() &&
              src.numel() == N * (K / f.block_values) * f.block_bytes, "repack_gguf: src size");
  TORCH_CHECK(q.is_contiguous() && q.numel() * q.element_size() == N * K * f.bits / 8, "repack_gguf: q size");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32 && scale.numel() == N * (K / f.group),
              "repack_gguf: scale size");
  TORCH_CHECK(f.has_min ? (minv.is_contiguous() && minv.scalar_type() == torch::kFloat32 && minv.numel() == scale.numel())
                        : minv.numel() == 0, "repack_gguf: minv size");
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* qp = (uint8_t*)q.data_ptr();
  float* scp = scale.data_ptr<float>();
  float* mp = f.has_min ? minv.data_ptr<float>() : nullptr;
  dw::parallel_for(N, 16, at::get_num_threads(),
                   [&](int64_t n0, int64_t n1) { dw::repack_rows((int)type, sp, K, qp, scp, mp, n0, n1); });
}

// (group, bits, has_min) of the code a ggml type becomes, or None when it is not re-packed here
py::object repack_format(int64_t type) {
  dw::RepackFormat f;
  if (!dw::repack_format((int)type, &f)) return py::none();
  return py::make_tuple(f.group, f.bits, f.has_min);
}

// qkv: (B, T, (nh + 2 nkv) hd) f32 (q and k are rotated in place); cos, sin: (B, T, hd) f32;
// k_cache, v_cache: (B, nkv, cap, hd) f32; start[b]: cached length of row b. Appends the T new keys /
// values at start[b].. and returns (B, T, nh hd). vis (B, T, T) int64 / nvis (B, T) int64, both empty for
// causal attention: token t of row b sees the new tokens vis[b, t, :nvis[b, t]] (a token tree's paths).
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                               torch::Tensor v_cache, std::vector<int64_t> start, int64_t nh, int64_t nkv,
                               torch::Tensor vis, torch::Tensor nvis) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(), "qkv: (B, T, W) f32");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kv cache: contiguous f32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "cos/sin: f32");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), hd = k_cache.size(3), cap = k_cache.size(2);
  TORCH_CHECK(W == (nh + 2 * nkv) * hd && (int64_t)start.size() >= B && nh % nkv == 0, "shapes");
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(start[b] + T <= cap, "KV cache overflow");
    most = std::max(most, start[b] + T);
  }
  const bool tree = vis.numel() > 0;
  if (tree) {
    TORCH_CHECK(vis.scalar_type() == torch::kInt64 && nvis.scalar_type() == torch::kInt64 && vis.is_contiguous() &&
                nvis.is_contiguous() && vis.numel() == B * T * T && nvis.numel() == B * T, "vis (B, T, T) / nvis (B, T) int64");
    const int64_t* vp = vis.data_ptr<int64_t>();
    const int64_t* np = nvis.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * T; ++i) {
      TORCH_CHECK(np[i] >= 1 && np[i] <= T, "nvis out of range");
      for (int64_t j = 0; j < np[i]; ++j) TORCH_CHECK(vp[i * T + j] >= 0 && vp[i * T + j] < T, "vis out of range");
    }
  }
  float* qp = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  dw::rope_append(qp, cos.data_ptr<float>(), sin.data_ptr<float>(), kc, vc, start.data(), B, T, nh, nkv, hd, cap);
  auto out = torch::empty({B, T, nh * hd}, qkv.options());
  float* op = out.data_ptr<float>();
  const dw::IsaOps* ops = dw::active();
  const int threads = at::get_num_threads();
  const int64_t hc = dw::attend_heads_per_group(B, T, nh, nkv, threads);  // heads per group
  dw::parallel_for(B * T * nh / hc, 1, threads, [&](int64_t i0, int64_t i1) {  // groups: (row, token, hc heads)
    std::vector<float> p(most * hc);
    ops->attend_groups(qp, kc, vc, start.data(), B, T, nh, nkv, hd, cap, hc, op, i0, i1, p.data(),
                     tree ? vis.data_ptr<int64_t>() : nullptr, tree ? nvis.data_ptr<int64_t>() : nullptr);
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.scalar_type() == torch::kFloat32,
              "rms_norm: contiguous f32");
  const int64_t D = x.size(-1), M = x.numel() / D;
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "rms_norm: weight size");
  auto out = torch::empty_like(x);
  dw::rms_norm(x.data_ptr<float>(), weight.data_ptr<float>(), M, D, (float)eps, out.data_ptr<float>());
  return out;
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat32 && gu.is_contiguous(), "silu_mul: contiguous f32");
  const int64_t F2 = gu.size(-1), F = F2 / 2, M = gu.numel() / F2;
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, gu.options());
  dw::active()->silu_mul(gu.data_ptr<float>(), M, F, out.data_ptr<float>());
  return out;
}

std::string isa() { return dw::active()->name; }

bool set_isa(const std::string& name) { return dw::set_active(name.c_str()); }

bool set_isa_multi(const std::string& name) { return dw::set_multi(name.c_str()); }

std::string isa_multi() { return dw::multi_name(); }

std::vector<std::string> available_isas() {
  const char* names[16];
  const int n = dw::available_paths(names, 16);
  return std::vector<std::string>(names, names + n);
}

std::string cpu_features() { return dw::cpu_features(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmm", &qmm, "weight-only quantized matmul (CPU), the rule of qmm.h on the active path");
  m.def("dequantize_bf16", &dequantize_bf16, "int4 / int8 code -> (N, K) bf16 weights");
  m.def("repack_gguf", &repack_gguf, "GGUF blocks -> the kernel's code, exactly (repack.h)");
  m.def("repack_format", &repack_format, "(group, bits, has_min) of a re-packed ggml type, or None");
  m.def("decode_attention", &decode_attention, "rotary + KV append + attention for short forwards (layers.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, fp32 (layers.cpp)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [gate | up] projection, fp32 (layers.cpp)");
  m.def("isa", &isa, "the instruction-set path in use");
  m.def("set_isa", &set_isa, "force a path (scalar, avx2, avxvnni, avx512, avx512vnni, neon, neondot, vnni, auto)");
  m.def("set_isa_multi", &set_isa_multi, "the path for calls of 3 or more rows ('' = the same as isa())");
  m.def("isa_multi", &isa_multi, "the path for calls of 3 or more rows, '' when it is isa()'s");
  m.def("available_isas", &available_isas, "paths compiled in and supported by this CPU, lowest first");
  m.def("cpu_features", &cpu_features, "CPU features found by cpuid / getauxval");
}
