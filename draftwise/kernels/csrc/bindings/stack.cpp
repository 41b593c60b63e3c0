// The decoder layers of a short forward (decode, verification: models/transformer.py EXACT_MAX_T) in one call.
//
// The Python loop makes ~12 module and kernel calls a layer; for a small draft model (Qwen2.5-0.5B: 24 layers,
// a token in ~10 ms) their interpreter and dispatch overhead was ~1.4 ms a token. A Stack holds one model's
// weights (the K-quant x16 tensors of kquant.h, the RMSNorm weights) and runs the very same kernel functions the
// modules call, in the same order, on the same threads: rms_norm, the projections (each part of a concatenated
// projection, then its bias, as QLinear and Concat do), decode_attention, the residual adds, silu_mul. So a
// token's bits are those of the module path, which stays the reference (tests/test_models.py compares them).
#include <torch/extension.h>

#include <algorithm>
#include <tuple>
#include <vector>

// ops.cpp
void add_bias_(torch::Tensor y, torch::Tensor b);
torch::Tensor qmm_kq(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t N);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                               torch::Tensor v_cache, std::vector<int64_t> start, int64_t nh, int64_t nkv,
                               torch::Tensor vis, torch::Tensor nvis);

namespace {

// one QLinear of the K-quant rule: w the flat x16 bytes, fmt its format, N its outputs, bias (N,) f32 or empty
struct Part {
  torch::Tensor w;
  int64_t fmt, N;
  torch::Tensor bias;
};

// a projection: one part, or several whose outputs are concatenated (transformer.py Concat)
using Proj = std::vector<Part>;

struct Layer {
  torch::Tensor attn_norm, mlp_norm;  // (D,) f32
  Proj qkv, o, gate_up, down;
};

// x (M, K) f32 contiguous -> (M, sum of the parts' N)
torch::Tensor project(const torch::Tensor& x, const Proj& proj) {
  std::vector<torch::Tensor> ys;
  ys.reserve(proj.size());
  for (const Part& p : proj) {
    torch::Tensor y = qmm_kq(x, p.w, p.fmt, p.N);
    if (p.bias.numel()) add_bias_(y, p.bias);  // QLinear's bias, the same loop
    ys.push_back(y);
  }
  return ys.size() == 1 ? ys[0] : torch::cat(ys, -1);
}

// h += y (torch's h + y: one IEEE add per element, so the same bits), in place on h, a tensor of this call's own
void add_into(torch::Tensor& h, const torch::Tensor& y) {
  float* hp = h.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const int64_t n = h.numel();
  for (int64_t i = 0; i < n; ++i) hp[i] = hp[i] + yp[i];
}

Proj to_proj(const py::list& parts) {
  Proj proj;
  for (const py::handle& item : parts) {
    auto t = item.cast<py::tuple>();
    TORCH_CHECK(t.size() == 4, "Stack: a projection part is (w, fmt, N, bias)");
    Part p{t[0].cast<torch::Tensor>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<torch::Tensor>()};
    TORCH_CHECK(p.w.scalar_type() == torch::kUInt8 && p.w.is_contiguous() && p.w.dim() == 1, "Stack: w flat uint8");
    TORCH_CHECK(p.bias.numel() == 0 || (p.bias.scalar_type() == torch::kFloat32 && p.bias.is_contiguous() &&
                                        p.bias.numel() == p.N), "Stack: bias (N,) f32");
    proj.push_back(p);
  }
  TORCH_CHECK(!proj.empty(), "Stack: a projection needs a part");
  return proj;
}

class Stack {
 public:
  // layers: per decoder layer (attn_norm, qkv parts, o parts, mlp_norm, gate_up parts, down parts)
  Stack(const py::list& layers, int64_t nh, int64_t nkv, double eps) : nh_(nh), nkv_(nkv), eps_(eps) {
    for (const py::handle& item : layers) {
      auto t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 6, "Stack: a layer is (attn_norm, qkv, o, mlp_norm, gate_up, down)");
      Layer l{t[0].cast<torch::Tensor>(), t[3].cast<torch::Tensor>(), to_proj(t[1]), to_proj(t[2]), to_proj(t[4]),
              to_proj(t[5])};
      for (const torch::Tensor* w : {&l.attn_norm, &l.mlp_norm})
        TORCH_CHECK(w->scalar_type() == torch::kFloat32 && w->is_contiguous(), "Stack: norm weights f32");
      layers_.push_back(std::move(l));
    }
  }

  // h: (B, T, D) f32 (not modified), or (N, D) with index; cos/sin: (B, T, hd); k, v: (layers, rows >= B, nkv,
  // cap, hd) f32, the caches of rows 0..B-1; start[b]: row b's cached length; vis / nvis: a tree's visibility or
  // empty; ids: the layers to run, in order; taps: the layers whose output (the residual stream) is returned too;
  // index: empty, or packed rows (transformer.py Packing: the N real tokens' flat positions in the (B, T) batch,
  // (N,) int64) — the projections and MLPs run on those N tokens, attention on the padded layout, zeros at the
  // padding positions, exactly as Packing's pack / unpack. Returns the residual stream after the layers, shaped
  // as h, and one copy of it per layer of taps that ran, in the order run.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run(
      torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
      std::vector<int64_t> start, torch::Tensor vis, torch::Tensor nvis, std::vector<int64_t> ids,
      std::vector<int64_t> taps, torch::Tensor index) {
    const bool packed = index.numel() > 0;
    TORCH_CHECK(h.dim() == (packed ? 2 : 3) && h.scalar_type() == torch::kFloat32,
                "Stack.run: h (B, T, D), or (N, D) with index, f32");
    TORCH_CHECK(cos.dim() == 3, "Stack.run: cos (B, T, hd)");
    TORCH_CHECK(!packed || (index.scalar_type() == torch::kInt64 && index.dim() == 1 && index.size(0) == h.size(0)),
                "Stack.run: index (N,) int64, one per row of h");
    TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.size(0) == (int64_t)layers_.size() && v.size(0) == k.size(0),
                "Stack.run: k, v (layers, rows, nkv, cap, hd)");
    const int64_t B = cos.size(0), T = cos.size(1), D = h.size(-1);
    TORCH_CHECK(packed || (h.size(0) == B && h.size(1) == T), "Stack.run: h and cos disagree on (B, T)");
    py::gil_scoped_release nogil;  // ~10-30 ms of kernels: a server's other threads go on
    torch::Tensor x = h.contiguous().clone();  // (B, T, D) or (N, D): the residual stream, this call's own
    const int64_t M = x.numel() / D;           // rows through the projections: B T, or N
    std::vector<torch::Tensor> tapped;
    for (const int64_t i : ids) {
      TORCH_CHECK(i >= 0 && i < (int64_t)layers_.size(), "Stack.run: layer index out of range");
      const Layer& l = layers_[i];
      torch::Tensor kc = k.select(0, i).narrow(0, 0, B), vc = v.select(0, i).narrow(0, 0, B);
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "Stack.run: each layer's cache rows contiguous");
      torch::Tensor a = rms_norm(x, l.attn_norm, eps_).view({M, D});
      torch::Tensor qkv = project(a, l.qkv);  // (M, C)
      if (packed)  // Packing.unpack: zeros, then the real tokens' rows
        qkv = torch::zeros({B * T, qkv.size(1)}, qkv.options()).index_copy_(0, index, qkv);
      torch::Tensor att = decode_attention(qkv.view({B, T, -1}), cos, sin, kc, vc, start, nh_, nkv_, vis, nvis);
      att = att.view({B * T, -1});
      if (packed) att = att.index_select(0, index);  // Packing.pack
      add_into(x, project(att, l.o));
      torch::Tensor m = rms_norm(x, l.mlp_norm, eps_).view({M, D});
      add_into(x, project(silu_mul(project(m, l.gate_up)), l.down));
      if (std::find(taps.begin(), taps.end(), i) != taps.end()) tapped.push_back(x.clone());
    }
    return {x, tapped};
  }

  int64_t layers() const { return (int64_t)layers_.size(); }

 private:
  std::vector<Layer> layers_;
  int64_t nh_, nkv_;
  double eps_;
};

}  // namespace

void bind_stack(py::module_& m) {
  py::class_<Stack>(m, "Stack", "a model's decoder layers for short forwards in one call (stack.cpp)")
      .def(py::init<const py::list&, int64_t, int64_t, double>())
      .def("run", &Stack::run)
      .def_property_readonly("layers", &Stack::layers);
}
