// Emulator stand-in for cub::BlockScan (tests/emulator): the one member the project's kernels use, with cub's
// contract (every thread of the 1-D block calls it; the temp storage may be reused after a __syncthreads).
#pragma once
#include "moe_emu.h"

namespace cub {

template <class T, int kThreads>
class BlockScan {
 public:
  struct TempStorage {
    T in[kThreads];
    T out[kThreads];
    T total;
  };
  explicit BlockScan(TempStorage& s) : s_(s) {}
  void ExclusiveSum(T input, T& output, T& block_aggregate) {
    if (blockDim.x * blockDim.y * blockDim.z != kThreads) moe_emu::fail("cub::BlockScan: block size differs");
    const unsigned t = threadIdx.x;
    s_.in[t] = input;
    __syncthreads();
    if (t == 0) {
      T run = T(0);
      for (int i = 0; i < kThreads; ++i) {
        s_.out[i] = run;
        run = run + s_.in[i];
      }
      s_.total = run;
    }
    __syncthreads();
    output = s_.out[t];
    block_aggregate = s_.total;
  }

 private:
  TempStorage& s_;
};

}  // namespace cub
