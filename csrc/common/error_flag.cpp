#include "common/error_flag_torch.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <vector>

#include "common/error_flag.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace moe_graph {
namespace {
int32_t g_host_flags[2] = {0, 0};  // [error bits, non-finite flag]
std::mutex g_mutex;
std::vector<at::Tensor>& cuda_flags() {
  static std::vector<at::Tensor> flags;
  return flags;
}
}  // namespace

int32_t* error_flag_ptr(const at::Device& device) {
  if (device.is_cpu()) return &g_host_flags[0];
#ifdef MOE_GRAPH_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "moe_graph: error flag requested for unsupported device ", device.str());
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& flags = cuda_flags();
  const int idx = device.has_index() ? device.index() : c10::cuda::current_device();
  if (static_cast<int>(flags.size()) <= idx) flags.resize(idx + 1);
  if (!flags[idx].defined()) {
    c10::cuda::CUDAGuard guard(idx);
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
                "moe_graph: the first moe_graph op on cuda:", idx,
                " runs inside CUDA graph capture; run it once eagerly (warm-up) before capturing, so that the "
                "device error flag is allocated outside the graph");
    flags[idx] = at::zeros({2}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, idx));  // + non-finite
  }
  return flags[idx].data_ptr<int32_t>();
#else
  TORCH_CHECK(false, "moe_graph was built without CUDA; device ", device.str(), " is not supported");
#endif
}

at::Tensor error_flag_tensor(const at::Device& device) {
  int32_t* ptr = error_flag_ptr(device);  // allocates the CUDA flag on first use
#ifdef MOE_GRAPH_WITH_CUDA
  if (device.is_cuda()) {  // the owning tensor: no pointer-attribute query per call (these run inside captures)
    std::lock_guard<std::mutex> lock(g_mutex);
    return cuda_flags()[device.has_index() ? device.index() : c10::cuda::current_device()].narrow(0, 0, 1);
  }
#endif
  return at::from_blob(ptr, {1}, at::TensorOptions().dtype(at::kInt).device(device));
}

int32_t* nonfinite_flag_ptr(const at::Device& device) { return error_flag_ptr(device) + 1; }

at::Tensor nonfinite_flag_tensor(const at::Device& device) {
  int32_t* ptr = nonfinite_flag_ptr(device);
#ifdef MOE_GRAPH_WITH_CUDA
  if (device.is_cuda()) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return cuda_flags()[device.has_index() ? device.index() : c10::cuda::current_device()].narrow(0, 1, 1);
  }
#endif
  return at::from_blob(ptr, {1}, at::TensorOptions().dtype(at::kInt).device(device));
}

int64_t read_and_clear_error_flag(const at::Device& device) {
  if (device.is_cpu()) return __atomic_exchange_n(&g_host_flags[0], 0, __ATOMIC_RELAXED);
#ifdef MOE_GRAPH_WITH_CUDA
  int32_t* ptr = error_flag_ptr(device);
  const int idx = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard guard(idx);
  auto stream = c10::cuda::getCurrentCUDAStream(idx).stream();
  int32_t value = 0;
  C10_CUDA_CHECK(cudaMemcpyAsync(&value, ptr, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaMemsetAsync(ptr, 0, sizeof(int32_t), stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return value;
#else
  TORCH_CHECK(false, "moe_graph was built without CUDA; device ", device.str(), " is not supported");
#endif
}

}  // namespace moe_graph
