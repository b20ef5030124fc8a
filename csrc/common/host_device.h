// MOE_GRAPH_HD: marks the small functions that CPU code and CUDA kernels share (host and device, inlined).
#pragma once

#if defined(__CUDACC__)
#define MOE_GRAPH_HD __host__ __device__ __forceinline__
#else
#define MOE_GRAPH_HD inline
#endif
