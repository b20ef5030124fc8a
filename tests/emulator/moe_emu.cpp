// The fiber scheduler of the CUDA emulation (moe_emu.h). One OS thread; each CUDA thread of the running block is a
// fiber with its own stack (x86-64: a small register switch; elsewhere ucontext), annotated for AddressSanitizer.
//
// Environment (read once):
//   MOE_EMU_SCHEDULE  forward | reverse | random:<seed>   order of the runnable threads in each round and of blocks
//   MOE_EMU_FAULT     <kind>:<launch>:<call>   fault injection that the tests use to prove they can fail: the
//                     <call>-th (0-based, per thread; -1: every) synchronization of <kind> (syncthreads, syncwarp,
//                     named) in the <launch>-th launch of the process (0-based; -1: every launch) does nothing.
//   MOE_EMU_TRACE=1   one line per launch on stderr (ordinal, grid, block, dynamic shared memory)
#include "moe_emu.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MOE_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOE_EMU_ASAN 1
#endif
#endif
#if defined(MOE_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// cudaGetLastError / cudaGetErrorString for the launchers' error checks (no CUDA runtime is linked).
extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
extern "C" const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }

#if defined(__x86_64__)
// moe_emu_switch(save, to): pushes the callee-saved registers (and the FP control words) on the current stack,
// stores the stack pointer in *save, continues on `to`.
extern "C" void moe_emu_switch(void** save, void* to);
asm(R"(
.text
.globl moe_emu_switch
.type moe_emu_switch,@function
moe_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size moe_emu_switch, .-moe_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#endif

namespace moe_emu {
namespace {

constexpr size_t kStackBytes = size_t(512) << 10;
constexpr int kWarp = 32;

enum class State { kRunnable, kWaiting, kDone };
enum class Wait { kNone, kBlock, kNamed, kWarp };

struct Pending {
  bool in = false;
  Op op = Op::kSyncWarp;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0, width = 32;
};

struct Thread {
  char* stack = nullptr;  // usable part (a guard page below it)
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  uint3 tid{};
  int linear = 0;
  State state = State::kRunnable;
  Wait wait = Wait::kNone;
  int named_id = -1;
  uint64_t result = 0;
  int calls[3] = {0, 0, 0};  // syncthreads, syncwarp, named: for fault injection
  void* fake_stack = nullptr;
};

struct Warp {
  Pending pending[kWarp];
};

struct Fault {
  int kind = -1;  // 0 syncthreads, 1 syncwarp, 2 named
  long launch = -1, call = -1;
};

struct Emu {
  // configuration
  int order = 0;  // 0 forward, 1 reverse, 2 random
  uint64_t seed = 0;
  Fault fault;
  bool trace = false;
  long launches = 0;
  std::mt19937_64 rng;
  // the running block
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int nthreads = 0, live = 0;
  int block_arrived = 0;
  std::vector<int> named_arrived;
  Thread* cur = nullptr;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake = nullptr;
  std::vector<unsigned char> smem;
  std::vector<char*> stacks;  // reused between blocks
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  uint3 block_idx{};
  bool running = false;
};

bool parse_schedule(const char* spec, int* order, uint64_t* seed) {
  const std::string v(spec);
  if (v == "forward" || v.empty()) {
    *order = 0;
  } else if (v == "reverse") {
    *order = 1;
  } else if (v.rfind("random:", 0) == 0 && v.size() > 7) {
    *order = 2;
    *seed = std::strtoull(v.c_str() + 7, nullptr, 10);
  } else {
    return false;
  }
  return true;
}

Emu& emu() {
  static Emu e = [] {
    Emu x;
    if (const char* s = std::getenv("MOE_EMU_SCHEDULE")) {
      if (!parse_schedule(s, &x.order, &x.seed)) {
        std::fprintf(stderr, "moe_emu: MOE_EMU_SCHEDULE=%s: expected forward, reverse or random:<seed>\n", s);
        std::abort();
      }
    }
    x.rng.seed(x.seed);
    if (const char* f = std::getenv("MOE_EMU_FAULT")) {
      char kind[32] = {0};
      long l = -1, c = -1;
      if (std::sscanf(f, "%31[a-z]:%ld:%ld", kind, &l, &c) != 3) {
        std::fprintf(stderr, "moe_emu: MOE_EMU_FAULT=%s: expected <kind>:<launch>:<call>\n", f);
        std::abort();
      }
      const std::string k(kind);
      x.fault.kind = k == "syncthreads" ? 0 : k == "syncwarp" ? 1 : k == "named" ? 2 : -1;
      if (x.fault.kind < 0) {
        std::fprintf(stderr, "moe_emu: MOE_EMU_FAULT kind %s: expected syncthreads, syncwarp or named\n", kind);
        std::abort();
      }
      x.fault.launch = l;
      x.fault.call = c;
    }
    x.trace = std::getenv("MOE_EMU_TRACE") != nullptr;
    return x;
  }();
  return e;
}

void set_builtins(const Thread& t) {
  threadIdx = t.tid;
  blockIdx = emu().block_idx;
}

// Whether this synchronization of `kind` is skipped by the fault injection (counts the call).
bool skipped(int kind) {
  Emu& e = emu();
  const int n = e.cur->calls[kind]++;
  return e.fault.kind == kind && (e.fault.launch < 0 || e.fault.launch == e.launches - 1) &&
         (e.fault.call < 0 || e.fault.call == n);
}

[[noreturn]] void fail_at(const Thread* t, const char* what) {
  Emu& e = emu();
  if (t != nullptr)
    std::fprintf(stderr, "moe_emu: launch %ld, block (%u,%u,%u), thread (%u,%u,%u): %s\n", e.launches - 1,
                 e.block_idx.x, e.block_idx.y, e.block_idx.z, t->tid.x, t->tid.y, t->tid.z, what);
  else
    std::fprintf(stderr, "moe_emu: launch %ld, block (%u,%u,%u): %s\n", e.launches - 1, e.block_idx.x, e.block_idx.y,
                 e.block_idx.z, what);
  std::fflush(stderr);
  std::abort();
}

// ------------------------------------------------------------------------------------------ context switch --
void switch_to_scheduler(bool finished) {
  Emu& e = emu();
  Thread* t = e.cur;
#if defined(MOE_EMU_ASAN)
  __sanitizer_start_switch_fiber(finished ? nullptr : &t->fake_stack, e.sched_stack_bottom, e.sched_stack_size);
#endif
#if defined(__x86_64__)
  moe_emu_switch(&t->sp, e.sched_sp);
#else
  swapcontext(&t->uc, &e.sched_uc);
#endif
#if defined(MOE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(t->fake_stack, nullptr, nullptr);
#endif
  (void)finished;
}

void fiber_main() {
  Emu& e = emu();
#if defined(MOE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &e.sched_stack_bottom, &e.sched_stack_size);
#endif
  e.body(e.ctx);
  Thread* t = emu().cur;
  t->state = State::kDone;
  --e.live;
  // a warp collective that names this lane can no longer complete
  Warp& w = e.warps[t->linear / kWarp];
  for (int l = 0; l < kWarp; ++l)
    if (w.pending[l].in && (w.pending[l].mask >> (t->linear % kWarp) & 1u))
      fail_at(t, "a thread exited while its warp waits for it in a warp collective (mask names it)");
  // exited threads count as arrived at the block barrier
  if (e.block_arrived > 0 && e.block_arrived == e.live) {
    for (Thread& o : e.threads)
      if (o.state == State::kWaiting && o.wait == Wait::kBlock) o.state = State::kRunnable, o.wait = Wait::kNone;
    e.block_arrived = 0;
  }
  switch_to_scheduler(true);
  std::abort();  // never resumed
}

#if defined(__x86_64__)
extern "C" void moe_emu_fiber_entry() { fiber_main(); }
#else
void fiber_entry_uc() { fiber_main(); }
#endif

char* new_stack() {
  const size_t page = 4096;
  void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) fail_at(nullptr, "mmap of a fiber stack failed");
  mprotect(m, page, PROT_NONE);  // guard page: a stack overflow faults
  return static_cast<char*>(m) + page;
}

void prepare(Thread& t) {
#if defined(MOE_EMU_ASAN)
  __asan_unpoison_memory_region(t.stack, kStackBytes);
#endif
#if defined(__x86_64__)
  // initial frame popped by moe_emu_switch: [mxcsr, fpucw][r15 r14 r13 r12 rbx rbp][ret = entry][0]
  uintptr_t top = (reinterpret_cast<uintptr_t>(t.stack) + kStackBytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                                       // fake return address of the entry
  *--sp = reinterpret_cast<uint64_t>(&moe_emu_fiber_entry);        // ret target (16-byte aligned slot)
  for (int i = 0; i < 6; ++i) *--sp = 0;                           // rbp rbx r12 r13 r14 r15
  --sp;
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memcpy(reinterpret_cast<char*>(sp), &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  t.sp = sp;
#else
  getcontext(&t.uc);
  t.uc.uc_stack.ss_sp = t.stack;
  t.uc.uc_stack.ss_size = kStackBytes;
  t.uc.uc_link = nullptr;
  makecontext(&t.uc, fiber_entry_uc, 0);
#endif
}

void resume(Thread& t) {
  Emu& e = emu();
  e.cur = &t;
  set_builtins(t);
#if defined(MOE_EMU_ASAN)
  __sanitizer_start_switch_fiber(&e.sched_fake, t.stack, kStackBytes);
#endif
#if defined(__x86_64__)
  moe_emu_switch(&e.sched_sp, t.sp);
#else
  swapcontext(&e.sched_uc, &t.uc);
#endif
#if defined(MOE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(e.sched_fake, nullptr, nullptr);
#endif
  e.cur = nullptr;
}

// Suspends the current thread (state already set) until the scheduler resumes it.
void yield() { switch_to_scheduler(false); }

void run_block(dim3 block, size_t smem) {
  Emu& e = emu();
  const int n = static_cast<int>(block.x * block.y * block.z);
  e.nthreads = n;
  e.live = n;
  e.block_arrived = 0;
  e.named_arrived.assign(16, 0);
  e.threads.assign(n, Thread{});
  e.warps.assign((n + kWarp - 1) / kWarp, Warp{});
  while (static_cast<int>(e.stacks.size()) < n) e.stacks.push_back(new_stack());
  e.smem.assign(smem, 0xa5);  // garbage: dynamic shared memory starts undefined
  for (int i = 0; i < n; ++i) {
    Thread& t = e.threads[i];
    t.linear = i;
    t.tid = uint3{static_cast<unsigned>(i % block.x), static_cast<unsigned>(i / block.x % block.y),
                  static_cast<unsigned>(i / (block.x * block.y))};
    t.stack = e.stacks[i];
    prepare(t);
  }
  std::vector<int> order(n);
  for (;;) {
    order.clear();
    for (int i = 0; i < n; ++i)
      if (e.threads[i].state == State::kRunnable) order.push_back(i);
    if (order.empty()) break;
    if (e.order == 1) std::reverse(order.begin(), order.end());
    if (e.order == 2) std::shuffle(order.begin(), order.end(), e.rng);
    for (int i : order) resume(e.threads[i]);
  }
  if (e.live > 0) {
    std::string msg = "deadlock: no thread can run; waiting:";
    int shown = 0;
    for (const Thread& t : e.threads) {
      if (t.state != State::kWaiting || shown >= 8) continue;
      ++shown;
      msg += " t" + std::to_string(t.linear) +
             (t.wait == Wait::kBlock ? "@__syncthreads" : t.wait == Wait::kNamed ? "@bar.sync" : "@warp collective");
    }
    fail_at(nullptr, msg.c_str());
  }
}

uint64_t complete_result(const Warp& w, int lane, unsigned mask) {
  const Pending& p = w.pending[lane];
  const int width = p.width;
  if (width <= 0 || width > kWarp || (width & (width - 1)) != 0) fail_at(emu().cur, "shuffle width not a power of 2");
  const int first = lane & ~(width - 1), last = first + width - 1;
  int src = lane;
  switch (p.op) {
    case Op::kSyncWarp: return 0;
    case Op::kShflIdx: src = first + (p.arg & (width - 1)); break;
    case Op::kShflUp: src = lane - p.arg >= first ? lane - p.arg : lane; break;
    case Op::kShflDown: src = lane + p.arg <= last ? lane + p.arg : lane; break;
    case Op::kShflXor: src = (lane ^ p.arg) <= last && (lane ^ p.arg) >= first ? lane ^ p.arg : lane; break;
    case Op::kBallot:
    case Op::kAny:
    case Op::kAll: {
      unsigned b = 0;
      for (int l = 0; l < kWarp; ++l)
        if ((mask >> l & 1u) && w.pending[l].value) b |= 1u << l;
      return p.op == Op::kBallot ? b : p.op == Op::kAny ? (b != 0) : (b == mask);
    }
    case Op::kMatchAny: {
      unsigned b = 0;
      for (int l = 0; l < kWarp; ++l)
        if ((mask >> l & 1u) && w.pending[l].value == p.value) b |= 1u << l;
      return b;
    }
  }
  if (!(mask >> src & 1u)) fail_at(emu().cur, "shuffle reads a lane outside the mask (undefined on a GPU)");
  return w.pending[src].value;
}

}  // namespace

bool set_schedule(const char* spec) {
  Emu& e = emu();
  if (!parse_schedule(spec, &e.order, &e.seed)) return false;
  e.rng.seed(e.seed);
  return true;
}

[[noreturn]] void fail(const char* what) { fail_at(emu().cur, what); }

void* dynamic_smem() { return emu().smem.empty() ? nullptr : emu().smem.data(); }

void run_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx) {
  Emu& e = emu();
  if (e.running) fail_at(nullptr, "a launch from device code");
  const long ordinal = e.launches++;
  if (e.trace)
    std::fprintf(stderr, "moe_emu: launch %ld grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n", ordinal, grid.x, grid.y,
                 grid.z, block.x, block.y, block.z, smem);
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0)
    fail_at(nullptr, "invalid launch configuration (a GPU refuses it)");
  if (smem > 227 * 1024) fail_at(nullptr, "dynamic shared memory above 227 KiB");
  e.body = body;
  e.ctx = ctx;
  e.running = true;
  blockDim = block;
  gridDim = grid;
  const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> border(nblocks);
  for (uint64_t b = 0; b < nblocks; ++b) border[b] = b;
  if (e.order == 1) std::reverse(border.begin(), border.end());
  if (e.order == 2) std::shuffle(border.begin(), border.end(), e.rng);
  for (uint64_t b : border) {
    e.block_idx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                        static_cast<unsigned>(b / (uint64_t(grid.x) * grid.y))};
    run_block(block, smem);
  }
  e.running = false;
}

void sync_block() {
  Emu& e = emu();
  Thread* t = e.cur;
  if (t == nullptr) fail_at(nullptr, "__syncthreads outside a kernel");
  if (skipped(0)) return;
  t->state = State::kWaiting;
  t->wait = Wait::kBlock;
  if (++e.block_arrived == e.live) {
    for (Thread& o : e.threads)
      if (o.state == State::kWaiting && o.wait == Wait::kBlock) o.state = State::kRunnable, o.wait = Wait::kNone;
    e.block_arrived = 0;
  }
  yield();
}

void named_barrier(int id, int count) {
  Emu& e = emu();
  Thread* t = e.cur;
  if (t == nullptr) fail_at(nullptr, "bar.sync outside a kernel");
  if (id < 0 || id >= 16) fail_at(t, "bar.sync id outside 0..15");
  if (count <= 0 || count % kWarp != 0 || count > e.nthreads) fail_at(t, "bar.sync count not a multiple of 32");
  if (skipped(2)) return;
  t->state = State::kWaiting;
  t->wait = Wait::kNamed;
  t->named_id = id;
  if (++e.named_arrived[id] == count) {
    for (Thread& o : e.threads)
      if (o.state == State::kWaiting && o.wait == Wait::kNamed && o.named_id == id)
        o.state = State::kRunnable, o.wait = Wait::kNone;
    e.named_arrived[id] = 0;
  }
  yield();
}

uint64_t warp_op(Op op, unsigned mask, uint64_t value, int arg, int width) {
  Emu& e = emu();
  Thread* t = e.cur;
  if (t == nullptr) fail_at(nullptr, "a warp collective outside a kernel");
  if (op == Op::kSyncWarp && skipped(1)) return 0;
  const int lane = t->linear % kWarp, base = t->linear - lane;
  Warp& w = e.warps[t->linear / kWarp];
  if (!(mask >> lane & 1u)) fail_at(t, "a warp collective whose mask does not name the calling lane");
  for (int l = 0; l < kWarp; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (base + l >= e.nthreads) fail_at(t, "a warp collective whose mask names a lane past the block's threads");
    if (e.threads[base + l].state == State::kDone) fail_at(t, "a warp collective whose mask names an exited lane");
  }
  w.pending[lane] = Pending{true, op, mask, value, arg, width};
  bool all = true;
  for (int l = 0; l < kWarp && all; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Pending& p = w.pending[l];
    if (!p.in) {
      all = false;
    } else if (p.mask != mask || p.op != op) {
      fail_at(t, "lanes of one warp meet in different collectives (mask or kind differ)");
    }
  }
  t->state = State::kWaiting;
  t->wait = Wait::kWarp;
  if (all) {
    for (int l = 0; l < kWarp; ++l)
      if (mask >> l & 1u) e.threads[base + l].result = complete_result(w, l, mask);
    for (int l = 0; l < kWarp; ++l) {
      if (!(mask >> l & 1u)) continue;
      w.pending[l].in = false;
      Thread& o = e.threads[base + l];
      o.state = State::kRunnable;
      o.wait = Wait::kNone;
    }
  }
  yield();
  return t->result;
}

}  // namespace moe_emu
