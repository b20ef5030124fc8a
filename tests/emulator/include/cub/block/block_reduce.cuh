// Emulator stand-in for cub::BlockReduce (tests/emulator): Sum, whose result cub defines in thread 0 only (the
// other threads get a garbage value here, so a kernel that reads it elsewhere differs from the CPU).
#pragma once
#include "moe_emu.h"

namespace cub {

template <class T, int kThreads>
class BlockReduce {
 public:
  struct TempStorage {
    T in[kThreads];
  };
  explicit BlockReduce(TempStorage& s) : s_(s) {}
  T Sum(T input) {
    if (blockDim.x * blockDim.y * blockDim.z != kThreads) moe_emu::fail("cub::BlockReduce: block size differs");
    const unsigned t = threadIdx.x;
    s_.in[t] = input;
    __syncthreads();
    T total = T(0);
    if (t == 0)
      for (int i = 0; i < kThreads; ++i) total = total + s_.in[i];
    return t == 0 ? total : T(0x5a5a5a5a);
  }

 private:
  TempStorage& s_;
};

}  // namespace cub
