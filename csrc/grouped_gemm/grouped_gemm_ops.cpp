// Torch glue of the grouped GEMM: argument checks (errors name the tensor), the CPU implementation that defines
// the semantics, and the CUDA path that hands raw pointers to the torch-free launchers.
#include "grouped_gemm/grouped_gemm_ops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "common/error_flag.h"
#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "grouped_gemm/grouped_spans.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "grouped_gemm/grouped_gemm.h"
#endif

namespace moe_graph {
namespace {

// ------------------------------------------------------------------------------------------------ checks --

struct FwdShape {
  int64_t rows, n, k, num_experts;
  bool stacked;  // b is one [E, ., .] tensor
};

void check_splits(const at::Tensor& m_splits, const at::Tensor& a, int64_t num_experts, const char* op) {
  check_defined(m_splits, op, "m_splits");
  check_dim(m_splits, 1, op, "m_splits", "[num_experts] of token counts");
  check_dtype(m_splits, {at::kInt, at::kLong}, op, "m_splits");
  check_device(m_splits, a.device(), op, "m_splits");
  if (num_experts >= 0)
    TORCH_CHECK(m_splits.size(0) == num_experts, op, ": m_splits must have one entry per expert (", num_experts,
                "), got ", m_splits.size(0));
  check_contiguous(m_splits, op, "m_splits");
  // the CUDA kernels put experts on grid.y
  TORCH_CHECK(m_splits.size(0) <= 65535, op, ": at most 65535 experts per call, got m_splits of shape [",
              m_splits.size(0), "]");
}

void check_activation_dtype(const at::Tensor& t, const char* op, const char* name) {
  if (t.is_cuda())
    check_dtype(t, {at::kBFloat16, at::kHalf}, op, name);
  else
    check_dtype(t, {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble}, op, name);
}

// CUDA kernels use 16-byte vectors and TMA: rows of every operand must be 16-byte multiples.
void check_cuda_extent(int64_t extent, const char* op, const char* what) {
  TORCH_CHECK(extent % 8 == 0, op, ": on CUDA ", what, " must be a multiple of 8 (16-byte rows for bf16/fp16), got ",
              extent, "; pad the feature dimension");
}

FwdShape check_forward(const char* op, const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits,
                       bool trans_b, const std::optional<at::Tensor>& bias, const at::Tensor* out) {
  check_defined(a, op, "a");
  check_dim(a, 2, op, "a", "[tokens, in_features]");
  check_activation_dtype(a, op, "a");
  check_contiguous(a, op, "a");
  TORCH_CHECK(!b.empty(), op, ": b must be a [E, N, K] tensor or a non-empty list of per-expert weights");
  FwdShape s{a.size(0), 0, a.size(1), 0, false};
  const char* bl = trans_b ? "[N, K]" : "[K, N]";
  if (b.size() == 1 && b[0].dim() == 3) {
    const auto& w = b[0];
    s.stacked = true;
    s.num_experts = w.size(0);
    TORCH_CHECK(w.size(trans_b ? 2 : 1) == s.k, op, ": b must have shape [E, ", trans_b ? "N, K" : "K, N",
                "] with K = a.size(1) = ", s.k, ", got ", shape_str(w));
    s.n = w.size(trans_b ? 1 : 2);
    check_same_dtype(w, a, op, "b", "a");
    check_device(w, a.device(), op, "b");
    check_contiguous(w, op, "b");
  } else {
    s.num_experts = static_cast<int64_t>(b.size());
    for (size_t e = 0; e < b.size(); ++e) {
      const auto& w = b[e];
      const std::string name = "b[" + std::to_string(e) + "]";
      check_defined(w, op, name.c_str());
      TORCH_CHECK(w.dim() == 2, op, ": ", name, " must be a 2-D per-expert weight ", bl, ", got shape ",
                  shape_str(w));
      if (e == 0) s.n = w.size(trans_b ? 0 : 1);
      const std::vector<int64_t> want = trans_b ? std::vector<int64_t>{s.n, s.k} : std::vector<int64_t>{s.k, s.n};
      check_shape(w, want, op, name.c_str());
      check_same_dtype(w, a, op, name.c_str(), "a");
      check_device(w, a.device(), op, name.c_str());
      check_contiguous(w, op, name.c_str());
    }
  }
  TORCH_CHECK(s.num_experts > 0, op, ": need at least one expert");
  check_splits(m_splits, a, s.num_experts, op);
  if (bias.has_value() && bias->defined()) {
    check_shape(*bias, {s.num_experts, s.n}, op, "bias");
    check_same_dtype(*bias, a, op, "bias", "a");
    check_device(*bias, a.device(), op, "bias");
    check_contiguous(*bias, op, "bias");
  }
  if (out != nullptr) {
    check_shape(*out, {s.rows, s.n}, op, "out");
    check_same_dtype(*out, a, op, "out", "a");
    check_device(*out, a.device(), op, "out");
    check_contiguous(*out, op, "out");
  }
  if (a.is_cuda()) {
    check_cuda_extent(s.k, op, "K (a.size(1))");
    check_cuda_extent(s.n, op, "N (output features)");
    TORCH_CHECK(s.rows < (int64_t(1) << 31) && s.n < (int64_t(1) << 31) && s.k < (int64_t(1) << 31), op,
                ": every dimension must be below 2^31 (the kernels index rows with int), got a of shape ",
                shape_str(a), " and N = ", s.n);
    check_aligned16(a, op, "a");
    for (size_t e = 0; e < b.size(); ++e) check_aligned16(b[e], op, "b");
    if (bias.has_value() && bias->defined()) check_aligned16(*bias, op, "bias");
    if (out != nullptr) check_aligned16(*out, op, "out");
  }
  return s;
}

struct WgradShape {
  int64_t rows, n, k, num_experts;
};

WgradShape check_wgrad(const char* op, const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits) {
  check_defined(a, op, "a");
  check_defined(dy, op, "dy");
  check_dim(a, 2, op, "a", "[tokens, in_features]");
  check_dim(dy, 2, op, "dy", "[tokens, out_features]");
  check_activation_dtype(a, op, "a");
  check_same_dtype(dy, a, op, "dy", "a");
  check_device(dy, a.device(), op, "dy");
  check_contiguous(a, op, "a");
  check_contiguous(dy, op, "dy");
  TORCH_CHECK(dy.size(0) == a.size(0), op, ": dy must have as many rows as a (", a.size(0), "), got ",
              shape_str(dy));
  check_splits(m_splits, a, -1, op);
  WgradShape s{a.size(0), dy.size(1), a.size(1), m_splits.size(0)};
  TORCH_CHECK(s.num_experts > 0, op, ": m_splits must have at least one expert");
  if (a.is_cuda()) {
    check_cuda_extent(s.k, op, "K (a.size(1))");
    check_cuda_extent(s.n, op, "N (dy.size(1))");
    TORCH_CHECK(s.rows < (int64_t(1) << 31) && s.n < (int64_t(1) << 31) && s.k < (int64_t(1) << 31), op,
                ": every dimension must be below 2^31 (the kernels index rows with int), got a of shape ",
                shape_str(a), " and dy of shape ", shape_str(dy));
    check_aligned16(a, op, "a");
    check_aligned16(dy, op, "dy");
  }
  return s;
}

void check_bias_grad(const at::Tensor& dy, const at::Tensor& m_splits) {
  const char* op = "grouped_bias_grad";
  check_defined(dy, op, "dy");
  check_dim(dy, 2, op, "dy", "[tokens, out_features]");
  check_activation_dtype(dy, op, "dy");
  check_splits(m_splits, dy, -1, op);
}

// Returns per-expert [n, k] views of `out` (one [E, n, k] tensor or E tensors) after checking them.
std::vector<at::Tensor> check_wgrad_out(const char* op, at::TensorList out, const WgradShape& s, const at::Tensor& a) {
  std::vector<at::Tensor> views;
  auto check_one = [&](const at::Tensor& t, const char* name) {
    check_defined(t, op, name);
    if (t.scalar_type() != at::kFloat) check_same_dtype(t, a, op, name, "a (or float32)");
    check_device(t, a.device(), op, name);
    check_contiguous(t, op, name);
    if (a.is_cuda()) check_aligned16(t, op, name);
  };
  if (out.size() == 1 && out[0].dim() == 3) {
    check_shape(out[0], {s.num_experts, s.n, s.k}, op, "out");
    check_one(out[0], "out");
    for (int64_t e = 0; e < s.num_experts; ++e) views.push_back(out[0][e]);
  } else {
    TORCH_CHECK(static_cast<int64_t>(out.size()) == s.num_experts, op,
                ": out must be one [E, N, K] tensor or a list of E = ", s.num_experts, " [N, K] tensors, got a list of ",
                out.size());
    for (size_t e = 0; e < out.size(); ++e) {
      const std::string name = "out[" + std::to_string(e) + "]";
      check_shape(out[e], {s.n, s.k}, op, name.c_str());
      check_one(out[e], name.c_str());
      TORCH_CHECK(out[e].scalar_type() == out[0].scalar_type(), op, ": every out tensor must have the dtype of out[0]");
      views.push_back(out[e]);
    }
  }
  return views;
}

void check_mask(const std::optional<at::Tensor>& mask, const WgradShape& s, const at::Tensor& a, const char* op) {
  if (!mask.has_value() || !mask->defined()) return;
  check_shape(*mask, {s.num_experts}, op, "accumulate_mask");
  check_dtype(*mask, {at::kBool}, op, "accumulate_mask");
  check_device(*mask, a.device(), op, "accumulate_mask");
  check_contiguous(*mask, op, "accumulate_mask");
}

// ------------------------------------------------------------------------------------------- CPU semantics --

// Clamped spans of the experts (the rule of grouped_spans.h): starts[e], counts[e]; sets the host error flag.
void cpu_spans(const at::Tensor& m_splits, int64_t rows, std::vector<int64_t>& starts, std::vector<int64_t>& counts) {
  auto sp = m_splits.to(at::kLong);
  const int64_t* p = sp.data_ptr<int64_t>();
  const int64_t e = sp.size(0);
  starts.assign(e, 0);
  counts.assign(e, 0);
  int32_t err = 0;
  int64_t begin = 0;  // saturates at rows + 1 (later experts are all past the buffer): no int64 overflow
  for (int64_t i = 0; i < e; ++i) {
    bool negative, cut;
    const int64_t m = gg::clamp_split(p[i], rows, &negative);
    const gg::ExpertSpan span = gg::expert_span(begin, m, rows, &cut);
    if (negative) err |= kErrNegativeSplit;
    if (cut) err |= kErrSplitsOverflow;
    starts[i] = span.start;
    counts[i] = span.count;
    begin = std::min(begin + m, rows + 1);
  }
  if (err) set_host_error(error_flag_ptr(at::Device(at::kCPU)), err);
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor expert_weight(at::TensorList b, int64_t e, bool stacked) { return stacked ? b[0][e] : b[e]; }

void forward_cpu_into(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                      const std::optional<at::Tensor>& bias, const at::Tensor& out, const FwdShape& s) {
  std::vector<int64_t> starts, counts;
  cpu_spans(m_splits, s.rows, starts, counts);
  const auto ct = compute_type(a.scalar_type());
  int64_t total = 0;
  for (int64_t e = 0; e < s.num_experts; ++e) {
    total = starts[e] + counts[e];
    if (counts[e] == 0) continue;
    auto x = a.narrow(0, starts[e], counts[e]).to(ct);
    auto w = expert_weight(b, e, s.stacked).to(ct);
    auto y = at::mm(x, trans_b ? w.t() : w);  // compute type: fp32 (fp64 for fp64)
    if (bias.has_value() && bias->defined()) y = y + (*bias)[e].to(ct);  // bias added before the one rounding
    out.narrow(0, starts[e], counts[e]).copy_(y);
  }
  if (total < s.rows) out.narrow(0, total, s.rows - total).zero_();
}

std::vector<at::Tensor> per_expert(at::TensorList out, int64_t num_experts) {
  if (out.size() == 1 && out[0].dim() == 3) {
    std::vector<at::Tensor> views;
    for (int64_t e = 0; e < num_experts; ++e) views.push_back(out[0][e]);
    return views;
  }
  return out.vec();
}

void wgrad_cpu_into(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits, at::TensorList out,
                    bool accumulate, const std::optional<at::Tensor>& mask, const WgradShape& s) {
  const auto outs = per_expert(out, s.num_experts);
  std::vector<int64_t> starts, counts;
  cpu_spans(m_splits, s.rows, starts, counts);
  const auto ct = compute_type(a.scalar_type());
  at::Tensor mask_cpu;
  if (mask.has_value() && mask->defined()) mask_cpu = mask->to(at::kBool).contiguous();
  for (int64_t e = 0; e < s.num_experts; ++e) {
    const bool acc = mask_cpu.defined() ? mask_cpu.data_ptr<bool>()[e] : accumulate;
    auto& o = outs[e];
    const auto ot = compute_type(o.scalar_type()) == at::kDouble ? at::kDouble : ct;
    at::Tensor dw;
    if (counts[e] > 0) {
      auto x = a.narrow(0, starts[e], counts[e]).to(ct);
      auto g = dy.narrow(0, starts[e], counts[e]).to(ct);
      dw = at::mm(g.t(), x).to(ot);
    } else {
      dw = at::zeros({s.n, s.k}, o.options().dtype(ot));
    }
    if (acc) dw = dw + o.to(ot);
    o.copy_(dw);
  }
}

// ------------------------------------------------------------------------------------- op entry points --
// The same checks and allocation for both devices; `Into` is the device's implementation.
using ForwardInto = void (*)(const at::Tensor&, at::TensorList, const at::Tensor&, bool,
                             const std::optional<at::Tensor>&, const at::Tensor&, const FwdShape&);
using WgradInto = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList, bool,
                           const std::optional<at::Tensor>&, const WgradShape&);

template <ForwardInto Into>
at::Tensor forward_op(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                      const std::optional<at::Tensor>& bias) {
  const auto s = check_forward("grouped_gemm", a, b, m_splits, trans_b, bias, nullptr);
  auto out = at::empty({s.rows, s.n}, a.options());
  Into(a, b, m_splits, trans_b, bias, out, s);
  return out;
}

template <ForwardInto Into>
void forward_out_op(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                    const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const char* op = "grouped_gemm";
  const auto s = check_forward(op, a, b, m_splits, trans_b, bias, &out);
  check_writable(out, op, "out");
  std::vector<MemOperand> mem{{"a", a, false}, {"m_splits", m_splits, false}, {"out", out, true}};
  for (size_t e = 0; e < b.size(); ++e) mem.push_back({b.size() == 1 ? "b" : "b[" + std::to_string(e) + "]", b[e], false});
  if (bias.has_value() && bias->defined()) mem.push_back({"bias", *bias, false});
  check_outputs_disjoint(mem, op);
  Into(a, b, m_splits, trans_b, bias, out, s);
}

template <WgradInto Into>
at::Tensor wgrad_op(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                    std::optional<at::ScalarType> out_dtype) {
  const auto s = check_wgrad("grouped_gemm_wgrad", a, dy, m_splits);
  const auto dt = out_dtype.value_or(a.scalar_type());
  TORCH_CHECK(dt == a.scalar_type() || dt == at::kFloat, "grouped_gemm_wgrad: out_dtype must be float32 or a's dtype (",
              c10::toString(a.scalar_type()), "), got ", c10::toString(dt));
  auto out = at::empty({s.num_experts, s.n, s.k}, a.options().dtype(dt));
  Into(a, dy, m_splits, {out}, false, std::nullopt, s);
  return out;
}

template <WgradInto Into>
void wgrad_out_op(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits, at::TensorList out,
                  bool accumulate, const std::optional<at::Tensor>& accumulate_mask) {
  const char* op = "grouped_gemm_wgrad";
  const auto s = check_wgrad(op, a, dy, m_splits);
  check_wgrad_out(op, out, s, a);
  check_mask(accumulate_mask, s, a, op);
  // every output is validated before anything is written: writable, and disjoint from the inputs and each other
  const bool stacked = out.size() == 1 && out[0].dim() == 3;
  std::vector<MemOperand> mem{{"a", a, false}, {"dy", dy, false}, {"m_splits", m_splits, false}};
  if (accumulate_mask.has_value() && accumulate_mask->defined())
    mem.push_back({"accumulate_mask", *accumulate_mask, false});
  for (size_t e = 0; e < out.size(); ++e) {
    std::string name = stacked ? "out" : "out[" + std::to_string(e) + "]";
    check_writable(out[e], op, name.c_str());
    mem.push_back({std::move(name), out[e], true});
  }
  check_outputs_disjoint(mem, op);
  Into(a, dy, m_splits, out, accumulate, accumulate_mask, s);
}

}  // namespace

// ------------------------------------------------------------------------------------------------- CPU ops --

at::Tensor grouped_gemm_cpu(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                            const std::optional<at::Tensor>& bias) {
  return forward_op<forward_cpu_into>(a, b, m_splits, trans_b, bias);
}

void grouped_gemm_out_cpu(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                          const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  forward_out_op<forward_cpu_into>(a, b, m_splits, trans_b, bias, out);
}

at::Tensor grouped_gemm_wgrad_cpu(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                  std::optional<at::ScalarType> out_dtype) {
  return wgrad_op<wgrad_cpu_into>(a, dy, m_splits, out_dtype);
}

void grouped_gemm_wgrad_out_cpu(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                at::TensorList out, bool accumulate, const std::optional<at::Tensor>& accumulate_mask) {
  wgrad_out_op<wgrad_cpu_into>(a, dy, m_splits, out, accumulate, accumulate_mask);
}

at::Tensor grouped_bias_grad_cpu(const at::Tensor& dy, const at::Tensor& m_splits) {
  check_bias_grad(dy, m_splits);
  std::vector<int64_t> starts, counts;
  cpu_spans(m_splits, dy.size(0), starts, counts);
  const auto ct = dy.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto db = at::zeros({m_splits.size(0), dy.size(1)}, dy.options().dtype(ct));
  for (int64_t e = 0; e < m_splits.size(0); ++e)
    if (counts[e] > 0) db[e].copy_(dy.narrow(0, starts[e], counts[e]).to(ct).sum(0));
  return db;
}

// ------------------------------------------------------------------------------------------------ CUDA ops --
#ifdef MOE_GRAPH_WITH_CUDA
namespace {

gg::DType to_gg(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return gg::DType::kBF16;
    case at::kHalf:
      return gg::DType::kF16;
    case at::kFloat:
      return gg::DType::kF32;
    default:
      TORCH_CHECK(false, "moe_graph: unsupported dtype ", c10::toString(t));
  }
}

struct DeviceInfo {
  int sm_count = 0, arch = 0;
};

// Multiprocessor count and compute capability, queried once per device (host attribute calls, no sync).
DeviceInfo device_info(int device) {  // by value: the cache may grow under another thread
  static std::mutex mu;
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1);
  auto& d = cache[device];
  if (d.arch == 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    d.arch = major * 10 + minor;
  }
  return d;
}

}  // namespace

// Launch environment of the current device/stream; workspace from PyTorch's caching allocator (graph-safe, and
// kept alive in `keep` until the launches are enqueued).
gg::LaunchEnv make_env(const at::Tensor& like, std::vector<at::Tensor>& keep) {
  gg::LaunchEnv env;
  env.device = like.device().index();
  const auto& info = device_info(env.device);
  // torch's SM carve-out (torch._C._set_sm_carveout_experimental), read per call: SMs left to communication
  // kernels that overlap the GEMM; the persistent CUTLASS kernels size their grid from what remains.
  env.sm_count = gg::effective_sm_count(info.sm_count, at::globalContext()._SMCarveout_EXPERIMENTAL().value_or(0));
  env.arch = info.arch;
  env.stream = c10::cuda::getCurrentCUDAStream(env.device).stream();
  env.error_flag = error_flag_ptr(like.device());
  auto opts = like.options().dtype(at::kByte);
  env.alloc = [&keep, opts](size_t bytes) -> void* {
    keep.push_back(at::empty({static_cast<int64_t>(bytes)}, opts));
    return keep.back().data_ptr();
  };
  return env;
}

gg::Splits to_splits(const at::Tensor& m_splits) {
  return gg::Splits{m_splits.data_ptr(), m_splits.scalar_type() == at::kLong, static_cast<int>(m_splits.size(0))};
}

void run_guarded(const char* op, const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
}

namespace {

void forward_cuda_into(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out, const FwdShape& s) {
  c10::cuda::CUDAGuard guard(a.device());
  std::vector<at::Tensor> keep;
  auto env = make_env(a, keep);
  gg::ForwardProblem p;
  p.dtype = to_gg(a.scalar_type());
  p.b_k_major = trans_b;
  p.rows = s.rows;
  p.n = s.n;
  p.k = s.k;
  p.a = a.data_ptr();
  std::vector<const void*> ptrs;
  if (s.stacked) {
    p.b.base = b[0].data_ptr();
    p.b.expert_stride = s.n * s.k;
  } else {
    for (const auto& w : b) ptrs.push_back(w.data_ptr());
    p.b.list = ptrs.data();
  }
  p.out = out.data_ptr();
  p.bias = (bias.has_value() && bias->defined()) ? bias->data_ptr() : nullptr;
  p.splits = to_splits(m_splits);
  run_guarded("grouped_gemm", [&] { gg::run_forward(p, env); });
}

void wgrad_cuda_into(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits, at::TensorList out,
                     bool accumulate, const std::optional<at::Tensor>& mask, const WgradShape& s) {
  const bool stacked = out.size() == 1 && out[0].dim() == 3;
  c10::cuda::CUDAGuard guard(a.device());
  std::vector<at::Tensor> keep;
  auto env = make_env(a, keep);
  gg::WgradProblem p;
  p.dtype = to_gg(a.scalar_type());
  p.out_dtype = to_gg(out[0].scalar_type());
  p.rows = s.rows;
  p.n = s.n;
  p.k = s.k;
  p.a = a.data_ptr();
  p.dy = dy.data_ptr();
  std::vector<const void*> ptrs;
  if (stacked) {
    p.out.base = out[0].data_ptr();
    p.out.expert_stride = s.n * s.k;
  } else {
    for (const auto& t : out) ptrs.push_back(t.data_ptr());
    p.out.list = ptrs.data();
  }
  p.accumulate_all = accumulate;
  p.accumulate_mask = (mask.has_value() && mask->defined()) ? mask->data_ptr<bool>() : nullptr;
  p.splits = to_splits(m_splits);
  run_guarded("grouped_gemm_wgrad", [&] { gg::run_wgrad(p, env); });
}
}  // namespace

at::Tensor grouped_gemm_cuda(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                             const std::optional<at::Tensor>& bias) {
  return forward_op<forward_cuda_into>(a, b, m_splits, trans_b, bias);
}

void grouped_gemm_out_cuda(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                           const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  forward_out_op<forward_cuda_into>(a, b, m_splits, trans_b, bias, out);
}

at::Tensor grouped_gemm_wgrad_cuda(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                   std::optional<at::ScalarType> out_dtype) {
  return wgrad_op<wgrad_cuda_into>(a, dy, m_splits, out_dtype);
}

void grouped_gemm_wgrad_out_cuda(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                 at::TensorList out, bool accumulate,
                                 const std::optional<at::Tensor>& accumulate_mask) {
  wgrad_out_op<wgrad_cuda_into>(a, dy, m_splits, out, accumulate, accumulate_mask);
}

at::Tensor grouped_bias_grad_cuda(const at::Tensor& dy, const at::Tensor& m_splits) {
  const char* op = "grouped_bias_grad";
  check_bias_grad(dy, m_splits);
  check_contiguous(dy, op, "dy");
  c10::cuda::CUDAGuard guard(dy.device());
  auto db = at::empty({m_splits.size(0), dy.size(1)}, dy.options().dtype(at::kFloat));
  std::vector<at::Tensor> keep;
  auto env = make_env(dy, keep);
  gg::BiasGradProblem p;
  p.dtype = to_gg(dy.scalar_type());
  p.rows = dy.size(0);
  p.n = dy.size(1);
  p.dy = dy.data_ptr();
  p.out = db.data_ptr<float>();
  p.splits = to_splits(m_splits);
  run_guarded(op, [&] { gg::run_bias_grad(p, env); });
  return db;
}
#endif

}  // namespace moe_graph
