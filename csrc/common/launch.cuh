// The one way the project's kernels are launched, and the device helpers whose spelling differs between a GPU and
// the CPU emulation of the CUDA execution model (tests/emulator). Under nvcc, launch() is `kernel<<<...>>>(args...)`;
// compiled as host C++ with MOE_GRAPH_EMULATE (the emulator test build), the same call runs the grid on the CPU,
// each block's threads as cooperative fibers. Launch errors are still read with cudaGetLastError() after the call.
#pragma once

#include <cstddef>
#include <utility>

#if defined(MOE_GRAPH_EMULATE)
#include "moe_emu.h"  // tests/emulator/moe_emu.h (on the emulator build's include path only)
#else
#include <cuda_runtime_api.h>
#endif

namespace moe_graph {

// kernel<<<grid, block, smem, stream>>>(args...): `args` convert to the kernel's parameter types.
template <class... Params, class... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
#if defined(MOE_GRAPH_EMULATE)
  ::moe_emu::launch(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
#endif
}

// Whether a block of `threads` threads fits the SM's 64K registers at `regs` registers per thread (sm_70 to sm_100):
// registers are allocated per warp in units of 256, and warps in groups of 4 (a 17- or 18-warp block is charged
// as 20 warps). The runtime refuses a launch past it ("too many resources requested for launch"); ptxas knows it
// only through __launch_bounds__, not through __maxnreg__.
constexpr bool launch_fits_registers(int threads, int regs) {
  const int warps = (threads + 31) / 32;
  const int per_warp = (regs * 32 + 255) / 256 * 256;
  return regs <= 255 && (warps + 3) / 4 * 4 * per_warp <= 65536;
}

// bar.sync kId, threads: a barrier among `threads` threads (whole warps) of the block, apart from __syncthreads.
template <int kId>
__device__ __forceinline__ void named_barrier_sync(int threads) {
#if defined(MOE_GRAPH_EMULATE)
  ::moe_emu::named_barrier(kId, threads);
#else
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "r"(threads) : "memory");
#endif
}

// The launch's dynamic shared memory (extern __shared__), as an array of T.
template <class T>
__device__ __forceinline__ T* dynamic_smem() {
#if defined(MOE_GRAPH_EMULATE)
  return static_cast<T*>(::moe_emu::dynamic_smem());
#else
  extern __shared__ __align__(16) unsigned char moe_graph_dynamic_smem[];
  return reinterpret_cast<T*>(moe_graph_dynamic_smem);
#endif
}

}  // namespace moe_graph
