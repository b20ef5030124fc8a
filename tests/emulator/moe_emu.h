// The CUDA execution model on a CPU, for the project's own kernels (csrc/**/*_cuda.cu compiled as host C++ with
// -DMOE_GRAPH_EMULATE -include moe_emu.h). A launch runs the grid block by block; a block's threads are cooperative
// fibers. A block barrier (__syncthreads, bar.sync id, n) or a warp collective (__syncwarp, shuffles, ballot, match)
// suspends the thread until every participant has arrived (the warp collectives check that the participants named
// by the mask arrive at the same kind of collective, and none of them has exited); between two synchronization
// points the runnable threads run one after the other in the schedule's order (forward, reverse or seeded random,
// chosen again at every round), and blocks run in the same kind of order. A result that depends on that order is a
// race the kernel does not synchronize. Shared memory: static __shared__ variables are function statics (blocks run
// one at a time, except in the multi-device mode below), dynamic shared memory a heap buffer of exactly the
// launch's size (AddressSanitizer sees overruns) filled with a garbage pattern. Atomics are plain read-modify-writes
// (one OS thread), __threadfence a no-op; the system-scope peer-memory operations follow the cross-device memory
// model of the multi-device mode.
//
// Not modelled (only a GPU shows them): memory ordering (outside the multi-device mode's peer-memory model) between
// blocks and between threads of a block without a barrier (a fiber runs until its next synchronization point, so no
// data race inside a phase is interleaved), warp-synchronous code that relies on lockstep without __syncwarp,
// timing, occupancy and resource limits (registers, shared memory size), TMA / wgmma / tensor cores, and the device
// math intrinsics (the host math of the shared __host__ __device__ functions runs instead).
#pragma once

#define MOE_GRAPH_EMULATE 1
#define __host__
#define __device__
#define __global__
#define __shared__ static

#include <cuda_runtime_api.h>
#include <vector_functions.h>
#include <vector_types.h>

#undef __maxnreg__
#define __maxnreg__(n)
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// Per-thread built-ins: the scheduler sets them before it resumes a fiber.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

namespace moe_emu {

enum class Op : int { kSyncWarp, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kMatchAny };

// The order of runnable threads and of blocks: "forward", "reverse" or "random:<seed>" (MOE_EMU_SCHEDULE's
// syntax); returns false for anything else.
bool set_schedule(const char* spec);

// Runs the grid: `body(ctx)` on every thread of every block.
void run_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx);
void sync_block();                                   // __syncthreads
void named_barrier(int id, int threads);             // bar.sync id, threads
uint64_t warp_op(Op op, unsigned mask, uint64_t value, int arg, int width);
void* dynamic_smem();
[[noreturn]] void fail(const char* what);

// ---- multi-device mode (docs/emulator.md): R virtual devices, their launches run concurrently ----------------
// Between multi_begin and multi_run every launch is queued on the current device (set_device); multi_run runs all
// queues at once (a device's launches in order, the devices' threads interleaved round by round) and fails on a
// deadlock: a round in which no thread makes progress (every live thread waits at a barrier or polls a signal that
// does not reach its target). Static __shared__ variables are function statics: kernels that run in this mode keep
// their shared state in dynamic shared memory.
bool multi_active();
void multi_begin(int devices);
void set_device(int device);
void multi_run();
void queue_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx, void (*destroy)(void*));
// The cross-device memory model (csrc/common/peer_memory.cuh calls these). A tracked store (a store into a peer's
// memory) writes poison (0xFF bytes) at once and its data only when it becomes visible: when a thread acquires a
// signal that a release (or a fence followed by a signal store) carried after the store (the writer's own earlier
// stores, those ordered before it by a block barrier, those of earlier launches on its device). Every access is a
// scheduling point. Outside the multi-device mode tracked stores are plain stores.
void tracked_store(void* dst, const void* src, size_t bytes);
void peer_read(void* dst, const void* src, size_t bytes);
void fence_system();
void signal_write(uint64_t* p, uint64_t v, bool add, bool release);
uint64_t signal_read(const uint64_t* p, bool acquire);
void wait_signal(const uint64_t* p, uint64_t target);
// Fault injection of the peer-memory kinds (MOE_EMU_FAULT=peer / nosignal / guard): the peer a signal goes to
// (another one, or -1: none) and whether the capacity guard is removed.
int64_t fault_peer(int64_t peer, int64_t ranks);
bool fault_unguarded();

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t, Args&&... args) {
  // The arguments are converted to the parameter types once, as a launch does, and every thread gets a copy.
  struct Ctx {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  };
  auto body = [](void* c) {
    auto* x = static_cast<Ctx*>(c);
    std::apply(x->kernel, x->params);
  };
  if (multi_active()) {
    auto* heap = new Ctx{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
    queue_grid(grid, block, smem, body, heap, [](void* c) { delete static_cast<Ctx*>(c); });
    return;
  }
  Ctx ctx{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  run_grid(grid, block, smem, body, &ctx);
}

template <class T>
uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp collectives move at most 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T of_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

}  // namespace moe_emu

inline void __syncthreads() { moe_emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { moe_emu::warp_op(moe_emu::Op::kSyncWarp, mask, 0, 0, 32); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return moe_emu::of_bits<T>(moe_emu::warp_op(moe_emu::Op::kShflIdx, mask, moe_emu::bits_of(v), src, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return moe_emu::of_bits<T>(moe_emu::warp_op(moe_emu::Op::kShflUp, mask, moe_emu::bits_of(v), int(d), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return moe_emu::of_bits<T>(moe_emu::warp_op(moe_emu::Op::kShflDown, mask, moe_emu::bits_of(v), int(d), width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  return moe_emu::of_bits<T>(moe_emu::warp_op(moe_emu::Op::kShflXor, mask, moe_emu::bits_of(v), m, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(moe_emu::warp_op(moe_emu::Op::kBallot, mask, pred != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(moe_emu::warp_op(moe_emu::Op::kAny, mask, pred != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(moe_emu::warp_op(moe_emu::Op::kAll, mask, pred != 0, 0, 32));
}
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_any_sync takes 32- or 64-bit values");
  return static_cast<unsigned>(moe_emu::warp_op(moe_emu::Op::kMatchAny, mask, moe_emu::bits_of(v), 0, 32));
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}

// Atomics: one OS thread runs every fiber, and a fiber is never interrupted between two synchronization points.
#define MOE_EMU_ATOMIC(name, update)   \
  template <class T>                   \
  T name(T* p, T v) {                  \
    const T old = *p;                  \
    *p = (update);                     \
    return old;                        \
  }
MOE_EMU_ATOMIC(atomicAdd, old + v)
MOE_EMU_ATOMIC(atomicSub, old - v)
MOE_EMU_ATOMIC(atomicOr, old | v)
MOE_EMU_ATOMIC(atomicAnd, old & v)
MOE_EMU_ATOMIC(atomicMax, v > old ? v : old)
MOE_EMU_ATOMIC(atomicMin, v < old ? v : old)
MOE_EMU_ATOMIC(atomicExch, v)
#undef MOE_EMU_ATOMIC
template <class T>
T atomicCAS(T* p, T cmp, T v) {
  const T old = *p;
  if (old == cmp) *p = v;
  return old;
}

// CUDA's min / max overloads of integer and floating types.
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
