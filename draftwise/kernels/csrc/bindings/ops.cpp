// torch bindings of the kernel core (qmm.h): the only file that includes torch. Threads come from the
// kernel's own pool (pool.h; as many as kernel_threads(): torch's unless set), split over output columns, so a
// row's result never depends on the split.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "arch/x86/amx.h"
#include "core/kquant.h"
#include "core/pool.h"
#include "core/qmm.h"
#include "gguf/repack.h"

// The kernel's thread count: torch's (at::get_num_threads()) unless set_threads(n > 0) says otherwise —
// the model runs short forwards with torch's own pool at one thread (kernels/__init__.py serial_torch:
// torch's OpenMP threads woken for a small element-wise op stall for milliseconds on a busy core) and
// the matmuls on this many threads.
std::atomic<int> g_threads{0};
int kernel_threads() {
  const int t = g_threads.load(std::memory_order_relaxed);
  return t > 0 ? t : at::get_num_threads();
}
void set_threads(int64_t n) { g_threads.store(n > 0 ? (int)n : 0, std::memory_order_relaxed); }
int64_t get_threads() { return g_threads.load(std::memory_order_relaxed); }

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
  dw::parallel_for(N, 16, kernel_threads(), [&](int64_t n0, int64_t n1) { dw::qmm_columns(ops, a, q8, n0, n1); });
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
  dw::parallel_for(N, 64, kernel_threads(),
                   [&](int64_t n0, int64_t n1) { dw::dequantize_bf16_rows(qp, sp, mp, K, G, bits, op, n0, n1); });
  return out;
}

// n elements of E in bytes, rounded up to a cache line
template <class E>
size_t padded(int64_t n) {
  return (size_t(n) * sizeof(E) + 63) & ~size_t(63);
}

// A call's scratch, carved in cache lines from one buffer: this thread's, kept between calls up to 16 MB (a
// 128-row prompt chunk needs ~3.5 MB for the ffn_down's K = 8960; fresh zero-filled vectors per call took ~4 %
// of a prompt's prefill on the Intel Xeon), a larger one (huge calls) this call's own. Not zero-filled.
class ScratchArena {
 public:
  explicit ScratchArena(size_t need) {
    constexpr size_t kKeep = size_t(16) << 20;
    thread_local std::unique_ptr<uint8_t[]> kept;
    thread_local size_t kept_size = 0;
    uint8_t* base;
    if (need > kKeep) {
      own_.reset(new uint8_t[need + 64]);
      base = own_.get();
    } else {
      if (kept_size < need) kept.reset(new uint8_t[need + 64]), kept_size = need;
      base = kept.get();
    }
    next_ = (uint8_t*)(((uintptr_t)base + 63) & ~uintptr_t(63));
  }
  template <class E>
  E* take(int64_t n) {  // the next n elements (null for none)
    E* p = n > 0 ? (E*)next_ : nullptr;
    next_ += padded<E>(n);
    return p;
  }

 private:
  std::unique_ptr<uint8_t[]> own_;
  uint8_t* next_;
};

// The K-quant rule (kquant.h): x (M, K) f32 quantized per 256 (act_q8k) or, for the block formats, per 32
// (act_q8b), then run(args) over w, the x16 layout of an (N, K) tensor of format fmt
void kq_check_format(const char* what, int64_t fmt, int64_t K) {
  TORCH_CHECK(dw::kq_valid((int)fmt), what, ": format must be Q4_K (12), Q6_K (14), Q4_0 (102), Q4_1 (103), Q5_0 (106) "
              "or Q8_0 (108), not ", fmt);
  TORCH_CHECK(K > 0 && K % dw::kq_block_values((int)fmt) == 0, what, ": K must be a positive multiple of ",
              dw::kq_block_values((int)fmt));
}

template <class Run>
torch::Tensor kq_call(const char* what, torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t N, Run run) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: (M, K) f32");
  const int64_t M = x.size(0), K = x.size(1);
  kq_check_format(what, fmt, K);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == dw::kq_bytes((int)fmt, N, K),
              what, ": w does not hold an (N, K) tensor of this format");
  auto out = torch::empty({M, N}, x.options());
  const bool block = dw::kq_is_block((int)fmt);
  const int64_t nd = K / dw::kq_block_values((int)fmt);  // activation scales per row
  const dw::IsaOps* ops = dw::active();  // its act_k / act_b: the reference's bits on this path's vectors
  // the AMX path's tiles read the codes split into two bytes each: split once here, not by every chunk
  const bool split = !block && ops->act_split && ops->tiles_for && ops->tiles_for(M, (int)fmt);
  const int64_t nk = block ? 0 : M * (K / 32);  // the K-quant activations' per-32 arrays
  ScratchArena s(padded<int8_t>(M * K) + padded<float>(M * nd) + padded<int32_t>(block ? 0 : M * (K / 16)) +
                 padded<int32_t>(M * (K / 32)) + padded<uint8_t>(nk) + padded<int32_t>(nk) +
                 padded<int32_t>(block ? 0 : M * (K / 64)) + 2 * padded<int8_t>(split ? M * K : 0));
  int8_t* q = s.take<int8_t>(M * K);  // every element below is written before it is read
  float* d = s.take<float>(M * nd);
  int32_t *b16n = s.take<int32_t>(block ? 0 : M * (K / 16)), *b32 = s.take<int32_t>(M * (K / 32));
  uint8_t* e = s.take<uint8_t>(nk);
  int32_t *e32 = s.take<int32_t>(nk), *b32p = s.take<int32_t>(block ? 0 : M * (K / 64));
  int8_t *alo = s.take<int8_t>(split ? M * K : 0), *ahi = s.take<int8_t>(split ? M * K : 0);
  const float* xp = x.data_ptr<float>();
  dw::parallel_for(M, 1, kernel_threads(), [&](int64_t m0, int64_t m1) {
    if (block) {
      ops->act_b(xp + m0 * K, m1 - m0, K, q + m0 * K, d + m0 * nd, b32 + m0 * (K / 32));
    } else {
      ops->act_k(xp + m0 * K, m1 - m0, K, q + m0 * K, d + m0 * nd, b16n + m0 * (K / 16),
                 b32 + m0 * (K / 32), e + m0 * (K / 32));
      dw::kq_act_lanes(m0, m1, K, b32, e, e32, b32p);
      if (split)
        ops->act_split(q + m0 * K, e + m0 * (K / 32), m1 - m0, K, alo + m0 * K, ahi + m0 * K);
    }
  });
  dw::KqArgs a{};
  a.M = M, a.K = K, a.N = N, a.fmt = (int)fmt;
  a.w = w.data_ptr<uint8_t>();
  a.act = {q, d, b16n, b32, e, block ? nullptr : e32, block ? nullptr : b32p};
  if (split) a.act.alo = alo, a.act.ahi = ahi;
  a.out = out.data_ptr<float>();
  run(a);
  return out;
}

torch::Tensor qmm_kq(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t N) {
  return kq_call("qmm_kq", x, w, fmt, N, [](const dw::KqArgs& a) {
    const dw::IsaOps* ops = dw::active();  // the fastest for this rule at every row count (kernels._tune_multi)
    dw::parallel_for(dw::kq_tiles(a.N), 1, kernel_threads(), [&](int64_t t0, int64_t t1) { ops->qmm_k(a, t0, t1); });
  });
}

// the AMX tile kernel (arch/x86/amx.h) for any number of rows, on this thread: on emulated tiles (any CPU), or on
// the hardware where the amx path is verified (else an error naming the reason)
torch::Tensor kq_amx(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t N, bool emulated) {
  std::string why;
  TORCH_CHECK(emulated || dw::amx_usable(), "kq_amx: the AMX path is ", dw::amx_state_name(dw::amx_state(&why)), ": ", why);
  return kq_call("kq_amx", x, w, fmt, N, [&](const dw::KqArgs& a) {
    if (emulated) dw::kq_amx_emulated(a, 0, dw::kq_tiles(a.N));
    else TORCH_CHECK(dw::kq_amx_hardware(a, 0, dw::kq_tiles(a.N)), "kq_amx: the AMX path is not usable");
  });
}

// GGUF Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 bytes of an (N, K) tensor (rows one after the other) -> the x16 layout (kquant.h),
// written into `out` (kq_bytes uint8, e.g. the rows of a fused matrix) or, when it is empty, a new tensor
torch::Tensor kq_pack(torch::Tensor src, int64_t fmt, int64_t N, int64_t K, torch::Tensor out) {
  kq_check_format("kq_pack", fmt, K);
  TORCH_CHECK(src.scalar_type() == torch::kUInt8 && src.is_contiguous() &&
              src.numel() == N * (K / dw::kq_block_values((int)fmt)) * dw::kq_gguf_block((int)fmt), "kq_pack: src size");
  if (out.numel() == 0) out = torch::empty({dw::kq_bytes((int)fmt, N, K)}, torch::TensorOptions().dtype(torch::kUInt8));
  TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.is_contiguous() && out.numel() == dw::kq_bytes((int)fmt, N, K),
              "kq_pack: out size");
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  dw::parallel_for(N, 16, kernel_threads(),
                   [&](int64_t n0, int64_t n1) { dw::kq_pack_rows((int)fmt, sp, N, K, op, n0, n1); });
  return out;
}

// rows idx of an x16-layout (N, K) tensor, de-quantized: (len(idx), K) f32 (an embedding lookup)
torch::Tensor kq_rows(torch::Tensor w, int64_t fmt, int64_t N, int64_t K, torch::Tensor idx) {
  kq_check_format("kq_rows", fmt, K);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
              w.numel() == dw::kq_bytes((int)fmt, N, K), "kq_rows: w size");
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.dim() == 1, "kq_rows: idx (n,) int64");
  auto ic = idx.contiguous();
  const int64_t n = ic.numel();
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "kq_rows: row index out of range");
  auto out = torch::empty({n, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    dw::kq_dequant_rows((int)fmt, wp, N, K, op + i * K, ip[i], ip[i] + 1);
  }
  return out;
}

// the x16 layout -> (N, K) f32 weights (kquant.h kq_dequant_rows)
torch::Tensor kq_dequant(torch::Tensor w, int64_t fmt, int64_t N, int64_t K) {
  kq_check_format("kq_dequant", fmt, K);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
              w.numel() == dw::kq_bytes((int)fmt, N, K), "kq_dequant: w size");
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  dw::parallel_for(N, 16, kernel_threads(),
                   [&](int64_t n0, int64_t n1) { dw::kq_dequant_rows((int)fmt, wp, N, K, op + n0 * K, n0, n1); });
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
  dw::parallel_for(N, 16, kernel_threads(),
                   [&](int64_t n0, int64_t n1) { dw::repack_rows((int)type, sp, K, qp, scp, mp, n0, n1); });
}

// (group, bits, has_min) of the code a ggml type becomes, or None when it is not re-packed here
py::object repack_format(int64_t type) {
  dw::RepackFormat f;
  if (!dw::repack_format((int)type, &f)) return py::none();
  return py::make_tuple(f.group, f.bits, f.has_min);
}

// qkv: (B, T, (nh + 2 nkv) hd) f32; cos, sin: (B, T, hd) f32; k_cache, v_cache: (B, nkv, cap, hd) f32;
// start[b]: cached length of row b. Checks the shapes, rotates q and k in place and appends the T new keys /
// values at start[b].. (layers.cpp rope_append); returns the most keys a row then holds.
int64_t checked_rope_append(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, const std::vector<int64_t>& start, int64_t nh, int64_t nkv) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(), "qkv: (B, T, W) f32");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kv cache: contiguous f32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32, "cos/sin: f32");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), hd = k_cache.size(3), cap = k_cache.size(2);
  TORCH_CHECK(W == (nh + 2 * nkv) * hd && (int64_t)start.size() >= B && nh % nkv == 0, "shapes");
  TORCH_CHECK(cos.numel() == B * T * hd && sin.numel() == B * T * hd, "cos/sin: (B, T, hd)");
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(start[b] >= 0 && start[b] + T <= cap, "KV cache overflow");
    most = std::max(most, start[b] + T);
  }
  dw::rope_append(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<float>(),
                  v_cache.data_ptr<float>(), start.data(), B, T, nh, nkv, hd, cap);
  return most;
}

// checked_rope_append, then attention: returns (B, T, nh hd). vis (B, T, T) int64 / nvis (B, T) int64, both
// empty for causal attention: token t of row b sees the new tokens vis[b, t, :nvis[b, t]] (a token tree's paths).
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                               torch::Tensor v_cache, std::vector<int64_t> start, int64_t nh, int64_t nkv,
                               torch::Tensor vis, torch::Tensor nvis) {
  TORCH_CHECK(qkv.dim() == 3 && k_cache.dim() == 4, "qkv: (B, T, W), kv cache: (B, nkv, cap, hd)");
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = k_cache.size(3), cap = k_cache.size(2);
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
  const int64_t most = checked_rope_append(qkv, cos, sin, k_cache, v_cache, start, nh, nkv);
  float* qp = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  auto out = torch::empty({B, T, nh * hd}, qkv.options());
  float* op = out.data_ptr<float>();
  const dw::IsaOps* ops = dw::active();
  const int threads = kernel_threads();
  int64_t hc, tc;  // heads and tokens per group
  dw::attend_split(B, T, nh, nkv, threads, &hc, &tc);
  dw::parallel_for(dw::attend_groups_count(B, T, nh, hc, tc), 1, threads, [&](int64_t i0, int64_t i1) {
    // groups: (row, tc tokens, hc heads); scratch kept per thread up to 4 MB (a fresh 200 KB buffer per
    // call was mapped and faulted in anew: 10-25 us of a 40 us call), larger ones (long contexts) per call
    // so that no thread holds tens of MB after one long request
    constexpr size_t kKeep = size_t(1) << 20;  // floats
    thread_local std::vector<float> kept;
    std::vector<float> own;
    const size_t need = dw::attend_scratch(hc, tc, most);
    std::vector<float>& p = need <= kKeep ? kept : own;
    if (p.size() < need) p.resize(need);
    ops->attend_groups(qp, kc, vc, start.data(), B, T, nh, nkv, hd, cap, hc, tc, op, i0, i1, p.data(),
                     tree ? vis.data_ptr<int64_t>() : nullptr, tree ? nvis.data_ptr<int64_t>() : nullptr);
  });
  return out;
}

// rows per chunk of a row-wise op over rows of D values: ~64K values, so that a decode step's few rows stay
// on the calling thread (no hand-off) and a prompt's thousands are shared by the pool
int64_t rows_per_chunk(int64_t D) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(D, 1)); }

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.scalar_type() == torch::kFloat32,
              "rms_norm: contiguous f32");
  const int64_t D = x.size(-1), M = x.numel() / D;
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "rms_norm: weight size");
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // rows are independent: a prompt's rows on every thread, the same bits (a short forward's stay on this one)
  dw::parallel_for(M, rows_per_chunk(D), kernel_threads(), [&](int64_t m0, int64_t m1) {
    dw::rms_norm(xp + m0 * D, wp, m1 - m0, D, (float)eps, op + m0 * D);
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat32 && gu.is_contiguous(), "silu_mul: contiguous f32");
  const int64_t F2 = gu.size(-1), F = F2 / 2, M = gu.numel() / F2;
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const dw::IsaOps* ops = dw::active();
  // items of (row, 1024 columns), at least 16 to a chunk: one token's row stays on this thread, a pass of
  // 8 tokens shares its 72 items evenly (row-wise chunks of 7 rows left one thread 7 of them); every element
  // is computed the same way wherever it lies
  constexpr int64_t C = 1024;
  const int64_t per = (F + C - 1) / C;
  dw::parallel_for(M * per, 16, kernel_threads(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / per, j0 = (i % per) * C, n = std::min(C, F - j0);
      ops->silu_mul(gp + m * 2 * F + j0, gp + m * 2 * F + F + j0, n, op + m * F + j0);
    }
  });
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

// every path of core/paths.def, compiled in or not: (name, family, rank)
std::vector<std::tuple<std::string, std::string, int>> isa_table() {
  std::vector<std::tuple<std::string, std::string, int>> rows;
  for (int i = 0; i < dw::path_count(); ++i) {
    const dw::PathInfo p = dw::path_info(i);
    rows.emplace_back(p.name, p.family, p.rank);
  }
  return rows;
}

// (state, reason): "not built" / "unavailable" / "unchecked" / "verified" / "refused", and why (arch/x86/amx.h)
py::tuple amx_status() {
  std::string why;
  const dw::AmxState s = dw::amx_state(&why);
  return py::make_tuple(std::string(dw::amx_state_name(s)), why);
}

// the forked bit-for-bit check (arch/x86/amx.h amx_verify): mode "hardware" records the verdict; "emulated",
// "corrupt" (one output bit flipped) and "fault" (the hardware kernel even without AMX) only report
py::tuple amx_verify(const std::string& mode) {
  const int m = mode == "hardware" ? 0 : mode == "emulated" ? 1 : mode == "corrupt" ? 2 : mode == "fault" ? 3 : -1;
  TORCH_CHECK(m >= 0, "amx_verify: mode must be hardware, emulated, corrupt or fault");
  std::string why;
  bool ok;
  {
    py::gil_scoped_release nogil;  // the child may take a while; other Python threads go on
    ok = dw::amx_verify(m, &why);
  }
  return py::make_tuple(ok, why);
}

// y (M, N) += b (N,) row by row, on this thread: QLinear's bias (kernels/__init__.py) and stack.cpp's
void add_bias_(torch::Tensor y, torch::Tensor b) {
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32 && y.is_contiguous() &&
              b.is_contiguous() && y.size(-1) == b.numel(), "add_bias_: contiguous f32 (M, N) and (N,)");
  float* yp = y.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const int64_t N = b.numel(), M = y.numel() / N;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) yp[m * N + n] += bp[n];
}

void bind_stack(py::module_& m);  // stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_stack(m);
  m.def("qmm", &qmm, "weight-only quantized matmul (CPU), the rule of qmm.h on the active path");
  m.def("qmm_kq", &qmm_kq, "the K-quant rule (kquant.h): x @ W^T for Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 weights in the x16 layout");
  m.def("kq_pack", &kq_pack, "GGUF Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 rows -> the x16 layout");
  m.def("kq_rows", &kq_rows, "rows of an x16-layout tensor, de-quantized (embedding lookups)");
  m.def("kq_dequant", &kq_dequant, "x16 layout -> (N, K) f32 weights");
  m.def("dequantize_bf16", &dequantize_bf16, "int4 / int8 code -> (N, K) bf16 weights");
  m.def("repack_gguf", &repack_gguf, "GGUF blocks -> the kernel's code, exactly (repack.h)");
  m.def("repack_format", &repack_format, "(group, bits, has_min) of a re-packed ggml type, or None");
  m.def("decode_attention", &decode_attention, "rotary + KV append + attention for short forwards (layers.cpp)");
  m.def("rope_append", [](torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                          torch::Tensor v_cache, std::vector<int64_t> start, int64_t nh, int64_t nkv) {
    checked_rope_append(qkv, cos, sin, k_cache, v_cache, start, nh, nkv);
  }, "rotary on q and k in place + KV append, the step of decode_attention before attending (a long prefill's, "
     "whose attention torch computes)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, fp32 (layers.cpp)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [gate | up] projection, fp32 (layers.cpp)");
  m.def("set_threads", &set_threads, "the kernel's thread count (0: torch's)");
  m.def("get_threads", &get_threads, "the kernel's thread count as set (0: torch's)");
  m.def("add_bias_", &add_bias_, "y += b on this thread (no torch thread pool: a short forward's bias)");
  m.def("isa", &isa, "the instruction-set path in use");
  static const std::string set_isa_doc = [] {
    std::string d = "force a path (";
    for (int i = 0; i < dw::path_count(); ++i) d += std::string(dw::path_info(i).name) + ", ";
    return d + "vnni, auto)";
  }();
  m.def("set_isa", &set_isa, set_isa_doc.c_str());
  m.def("set_isa_multi", &set_isa_multi, "the path for calls of 3 or more rows ('' = the same as isa())");
  m.def("isa_multi", &isa_multi, "the path for calls of 3 or more rows, '' when it is isa()'s");
  m.def("available_isas", &available_isas, "paths compiled in and supported by this CPU, lowest first");
  m.def("isa_table", &isa_table, "every path of core/paths.def, compiled in or not: (name, family, rank)");
  m.def("cpu_features", &cpu_features, "CPU features found by cpuid / getauxval");
  m.def("kq_prefetch_l2", [](int64_t fmt) { kq_check_format("kq_prefetch_l2", fmt, 256); return dw::kq_prefetch_l2((int)fmt); },
        "whether the vector kernels prefetch this format's codes into L2 (else L1)");
  m.def("set_kq_prefetch_l2", [](int64_t fmt, bool l2) { kq_check_format("set_kq_prefetch_l2", fmt, 256); dw::kq_set_prefetch_l2((int)fmt, l2); },
        "prefetch this format's codes into L2 (true) or L1 (false): speed only, the same bits");
  m.def("kq6_many", &dw::kq6_many, "whether Q6_K's calls of several rows take the many-rows loop (else the few-rows one)");
  m.def("set_kq6_many", &dw::kq6_set_many, "Q6_K's calls of several rows: the many-rows loop (true) or the few-rows one "
        "(false): speed only, the same bits");
  m.def("kq6_many_mask", &dw::kq6_many_mask, "the Q6_K call shapes that take the many-rows loop (bit 2 r + l: rows up to "
        "6 / 7-8 / more for r = 0 / 1 / 2, K > 4096 for l = 1)");
  m.def("set_kq6_many_mask", [](int64_t mask) {
          TORCH_CHECK(mask >= 0 && mask <= (int64_t)dw::kKq6AllMany, "set_kq6_many_mask: a mask of 6 bits, got ", mask);
          dw::kq6_set_many_mask((uint32_t)mask);
        }, "the Q6_K call shapes that take the many-rows loop (kq6_many_mask's bits): speed only, the same bits");
  m.def("amx_status", &amx_status, "(state, reason) of the AMX path");
  m.def("amx_verify", &amx_verify, "the AMX tile kernel against the reference in a forked child: (identical, reason)");
  m.def("amx_set_verdict", [](bool ok, const std::string& reason) { dw::amx_set_verdict(ok, reason); },
        "a cached verdict of amx_verify('hardware') (taken only while the path is unchecked)");
  m.def("amx_bytes_check", &dw::amx_bytes_check, "the AMX kernel's AVX-512BW byte work against the emulation's: '' "
        "when equal, 'skipped: ...' where it cannot run, else the first difference");
  m.def("amx_min_rows", [](int64_t fmt) { return dw::amx_min_rows((int)fmt); },
        "the fewest rows of a call of format fmt (Q4_K, Q6_K) that the amx path runs on the tiles (0: another format)");
  m.def("set_amx_min_rows", [](int64_t fmt, int64_t rows) {
          TORCH_CHECK(rows >= 1 && rows <= (1 << 30) && dw::amx_set_min_rows((int)fmt, (int)rows),
                      "set_amx_min_rows: format Q4_K (12) or Q6_K (14) and rows in 1..2^30, got ", fmt, ", ", rows);
        }, "the fewest rows of a call of format fmt that the amx path runs on the tiles: speed only, the same bits");
  m.def("amx_block_groups", &dw::amx_block_groups, "the most groups of 16 rows the tile kernel takes per block at K");
  m.def("set_amx_block_groups", &dw::amx_set_block_groups,
        "the tile kernel's groups of 16 rows per block (0: from their bytes): speed only, the same bits");
  m.def("kq_amx", &kq_amx, "the K-quant rule on the AMX tile kernel, any rows, this thread (emulated: any CPU)");
}
