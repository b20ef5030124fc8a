// Emulator stand-in for ATen's parallel_for (tests/emulator): the harness links no libtorch, and the CPU
// implementations it compares with run their ranges on one thread, in order.
#pragma once
#include <cstdint>

namespace at {

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t /*grain*/, const F& f) {
  if (begin < end) f(begin, end);
}

}  // namespace at
