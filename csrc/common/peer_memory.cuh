// Peer-memory primitives of the kernels that read and write other GPUs' memory (torch symmetric memory: every rank
// holds the same buffers, and `ptrs[r]` is rank r's copy mapped into this GPU's address space).
//
//   signals     64-bit words, written with system-scope release (st.release.sys / red.release.sys.add) and read
//               with system-scope acquire (ld.acquire.sys): everything the writing thread stored before the release
//               (and, cumulatively, what happened before it in its stream: earlier kernels) is visible to a thread
//               that acquires the value. Values only grow (epochs), so a wait is `value >= target`.
//   data        rows stored into (or loaded from) a peer's buffer with ordinary stores, 16-byte vectors where the
//               source, the destination and the length allow it, bytes otherwise; made visible by a later release.
//   wait        spins on an acquire load, backing off with __nanosleep. A peer that never signals hangs a GPU (as a
//               collective whose peer never joins does; a trap-on-timeout path made ptxas spill the kernels that
//               inline it); the emulator reports such a wait as a deadlock instead.
//
// Under MOE_GRAPH_EMULATE (tests/emulator) every primitive calls the emulator's cross-device memory model: a store
// into a peer is poison until the writer's release and the reader's acquire; a wait that can never be satisfied is
// reported as a deadlock. Fault injection (MOE_EMU_FAULT) can drop a fence, redirect a signal to another peer, drop
// a signal, or remove the capacity guard (guard_capacity).
#pragma once
#include <cstdint>

#if defined(MOE_GRAPH_EMULATE)
#include "moe_emu.h"
#define MOE_PEER_D inline
#else
#include <cuda_runtime_api.h>
#define MOE_PEER_D __device__ __forceinline__
#endif

namespace moe_graph {
namespace peer {

// Rank r's copy of a symmetric buffer at byte offset `offset`.
template <class T>
MOE_PEER_D T* at(const int64_t* ptrs, int64_t r, int64_t offset) {
  return reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(static_cast<uintptr_t>(ptrs[r])) + offset);
}

// fence.acq_rel.sys: orders this thread's earlier stores (and what it has observed) before its later ones, for every
// observer in the system.
MOE_PEER_D void fence_system() {
#if defined(MOE_GRAPH_EMULATE)
  ::moe_emu::fence_system();
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

MOE_PEER_D uint64_t load_acquire(const uint64_t* p) {
#if defined(MOE_GRAPH_EMULATE)
  return ::moe_emu::signal_read(p, true);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Signal word `word` of peer `peer` (of `ranks`) in the symmetric signal buffer `ptrs` (byte offset `offset`);
// null when the emulator's fault injection drops the signal (or sends it to another peer).
MOE_PEER_D uint64_t* signal_word(const int64_t* ptrs, int64_t ranks, int64_t peer, int64_t offset, int64_t word) {
#if defined(MOE_GRAPH_EMULATE)
  peer = ::moe_emu::fault_peer(peer, ranks);
  if (peer < 0) return nullptr;
#else
  (void)ranks;
#endif
  return at<uint64_t>(ptrs, peer, offset) + word;
}

// Release store of v into a peer's signal word.
MOE_PEER_D void signal_store(const int64_t* ptrs, int64_t ranks, int64_t peer, int64_t offset, int64_t word,
                             uint64_t v) {
  uint64_t* p = signal_word(ptrs, ranks, peer, offset, word);
#if defined(MOE_GRAPH_EMULATE)
  if (p != nullptr) ::moe_emu::signal_write(p, v, false, true);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Release add of v to a peer's signal word.
MOE_PEER_D void signal_add(const int64_t* ptrs, int64_t ranks, int64_t peer, int64_t offset, int64_t word,
                           uint64_t v) {
  uint64_t* p = signal_word(ptrs, ranks, peer, offset, word);
#if defined(MOE_GRAPH_EMULATE)
  if (p != nullptr) ::moe_emu::signal_write(p, v, true, true);
#else
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Spins until *p >= target (acquire).
MOE_PEER_D void wait_at_least(const uint64_t* p, uint64_t target) {
#if defined(MOE_GRAPH_EMULATE)
  ::moe_emu::wait_signal(p, target);
#else
  if (load_acquire(p) >= target) return;
  for (unsigned spin = 0;; ++spin) {
    if (load_acquire(p) >= target) return;
    if (spin > 64) __nanosleep(128);
  }
#endif
}

// Copies `bytes` from src (local) to dst (a peer's memory), this lane's part of `lanes` cooperating threads.
MOE_PEER_D void store_bytes(void* dst, const void* src, int64_t bytes, int64_t lane, int64_t lanes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const bool vec = ((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | uintptr_t(bytes)) & 15u) == 0;
  if (vec) {
    for (int64_t i = lane; i < bytes / 16; i += lanes) {
#if defined(MOE_GRAPH_EMULATE)
      ::moe_emu::tracked_store(d + i * 16, s + i * 16, 16);
#else
      reinterpret_cast<int4*>(d)[i] = reinterpret_cast<const int4*>(s)[i];
#endif
    }
    return;
  }
  for (int64_t i = lane; i < bytes; i += lanes) {
#if defined(MOE_GRAPH_EMULATE)
    ::moe_emu::tracked_store(d + i, s + i, 1);
#else
    d[i] = s[i];
#endif
  }
}

// Zeroes `bytes` of a peer's memory (this lane's part).
MOE_PEER_D void zero_bytes(void* dst, int64_t bytes, int64_t lane, int64_t lanes) {
  auto* d = static_cast<unsigned char*>(dst);
  const bool vec = ((reinterpret_cast<uintptr_t>(d) | uintptr_t(bytes)) & 15u) == 0;
  if (vec) {
    for (int64_t i = lane; i < bytes / 16; i += lanes) {
#if defined(MOE_GRAPH_EMULATE)
      static const unsigned char z[16] = {};
      ::moe_emu::tracked_store(d + i * 16, z, 16);
#else
      reinterpret_cast<int4*>(d)[i] = make_int4(0, 0, 0, 0);
#endif
    }
    return;
  }
  for (int64_t i = lane; i < bytes; i += lanes) {
#if defined(MOE_GRAPH_EMULATE)
    const unsigned char z = 0;
    ::moe_emu::tracked_store(d + i, &z, 1);
#else
    d[i] = 0;
#endif
  }
}

// A value of a peer's memory.
template <class T>
MOE_PEER_D void store(T* dst, const T& v) {
#if defined(MOE_GRAPH_EMULATE)
  ::moe_emu::tracked_store(dst, &v, sizeof(T));
#else
  *dst = v;
#endif
}
template <class T>
MOE_PEER_D T load(const T* src) {
#if defined(MOE_GRAPH_EMULATE)
  T v;
  ::moe_emu::peer_read(&v, src, sizeof(T));
  return v;
#else
  return *src;
#endif
}

// The receive buffer's capacity as the kernels apply it (the emulator's fault injection can remove the guard).
MOE_PEER_D int64_t guard_capacity(int64_t capacity) {
#if defined(MOE_GRAPH_EMULATE)
  return ::moe_emu::fault_unguarded() ? (int64_t(1) << 40) : capacity;
#else
  return capacity;
#endif
}

}  // namespace peer
}  // namespace moe_graph
