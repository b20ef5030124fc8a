// The fiber scheduler of the CUDA emulation (moe_emu.h). One OS thread; each CUDA thread of the running block is a
// fiber with its own stack (x86-64: a small register switch; elsewhere ucontext), annotated for AddressSanitizer.
//
// Environment (read once):
//   MOE_EMU_SCHEDULE  forward | reverse | random:<seed>   order of the runnable threads in each round and of blocks
//   MOE_EMU_FAULT     <kind>:<launch>:<call>   fault injection that the tests use to prove they can fail: the
//                     <call>-th (0-based, per thread; -1: every) synchronization of <kind> (syncthreads, syncwarp,
//                     named) in the <launch>-th launch of the process (0-based; -1: every launch) does nothing;
//                     the peer-memory kinds: fence (a system fence, and the fence of a release, does nothing),
//                     peer (a signal goes to the next peer instead), nosignal (a signal is not sent), guard (the
//                     exchange's capacity guard is removed); peer and nosignal count the signals of a block.
//   MOE_EMU_TRACE=1   one line per launch on stderr (ordinal, grid, block, dynamic shared memory)
#include "moe_emu.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
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

struct Block;

// A store into another device's memory that is not visible yet (the memory holds poison meanwhile).
struct Store {
  unsigned char* dst = nullptr;
  std::vector<unsigned char> data;
};
// Stores made visible together: by the acquire of a signal that a release carried after them.
struct Batch {
  std::vector<Store> stores;
  bool applied = false;
};
using BatchP = std::shared_ptr<Batch>;

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
  int calls[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // per fault kind: for fault injection
  void* fake_stack = nullptr;
  Block* blk = nullptr;
  bool polled = false;                // the last yield was a poll that did not reach its target
  const void* poll_addr = nullptr;
  std::vector<Store> pending;         // tracked stores not fenced yet
  std::vector<BatchP> fenced;         // batches this thread's releases carry
};

struct Warp {
  Pending pending[kWarp];
};

struct Fault {
  int kind = -1;  // 0 syncthreads, 1 syncwarp, 2 named, 3 fence, 4 peer, 5 nosignal, 6 guard
  long launch = -1, call = -1;
};

// One running block.
struct Block {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int nthreads = 0, live = 0;
  int block_arrived = 0;
  std::vector<int> named_arrived;
  std::vector<unsigned char> smem;
  uint3 idx{};
  dim3 grid, dim;
  int device = 0;
  long ordinal = 0;  // launch ordinal (fault injection, messages)
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  std::vector<Store> pending;   // tracked stores ordered before the block's later releases by a block barrier
  std::vector<BatchP> fenced;
  int calls[8] = {0, 0, 0, 0, 0, 0, 0, 0};
};

// A queued launch of the multi-device mode.
struct Queued {
  dim3 grid, block;
  size_t smem = 0;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  void (*destroy)(void*) = nullptr;
  long ordinal = 0;
};

struct Device {
  std::vector<Queued> queue;
  size_t next = 0;
  std::vector<std::unique_ptr<Block>> blocks;  // of the running launch
  bool busy = false;
  int delay = 0;
  Queued cur;
  std::vector<Store> pending;   // tracked stores of finished launches (stream order: before later releases)
  std::vector<BatchP> fenced;
};

struct Emu {
  // configuration
  int order = 0;  // 0 forward, 1 reverse, 2 random
  uint64_t seed = 0;
  Fault fault;
  bool trace = false;
  long launches = 0;
  std::mt19937_64 rng;
  // the running block (single-device mode) / the block of the running thread
  Block* blk = nullptr;
  Thread* cur = nullptr;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake = nullptr;
  std::vector<char*> free_stacks;
  bool running = false;
  // multi-device mode
  bool multi = false;
  int device = 0;
  std::vector<Device> devices;
  std::unordered_map<const void*, std::vector<BatchP>> carried;  // signal word -> batches its writes released
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
      const char* kinds[] = {"syncthreads", "syncwarp", "named", "fence", "peer", "nosignal", "guard"};
      for (int i = 0; i < 7; ++i)
        if (k == kinds[i]) x.fault.kind = i;
      if (x.fault.kind < 0) {
        std::fprintf(stderr,
                     "moe_emu: MOE_EMU_FAULT kind %s: expected syncthreads, syncwarp, named, fence, peer, nosignal or "
                     "guard\n",
                     kind);
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
  blockIdx = t.blk->idx;
  blockDim = t.blk->dim;
  gridDim = t.blk->grid;
}

// Whether this synchronization of `kind` is skipped by the fault injection (counts the call).
bool skipped(int kind) {
  Emu& e = emu();
  // signals (peer, nosignal) count per block: the <call>-th signal any thread of the block sends
  const int n = kind == 4 || kind == 5 ? e.cur->blk->calls[kind]++ : e.cur->calls[kind]++;
  return e.fault.kind == kind && (e.fault.launch < 0 || e.fault.launch == e.cur->blk->ordinal) &&
         (e.fault.call < 0 || e.fault.call == n);
}

[[noreturn]] void fail_at(const Thread* t, const char* what) {
  Emu& e = emu();
  const Block* b = t != nullptr ? t->blk : e.blk;
  if (t != nullptr)
    std::fprintf(stderr, "moe_emu: device %d, launch %ld, block (%u,%u,%u), thread (%u,%u,%u): %s\n", b->device,
                 b->ordinal, b->idx.x, b->idx.y, b->idx.z, t->tid.x, t->tid.y, t->tid.z, what);
  else if (b != nullptr)
    std::fprintf(stderr, "moe_emu: device %d, launch %ld, block (%u,%u,%u): %s\n", b->device, b->ordinal, b->idx.x,
                 b->idx.y, b->idx.z, what);
  else
    std::fprintf(stderr, "moe_emu: %s\n", what);
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

// Completes the block barrier: the waiting threads run again; their tracked stores and released batches are
// ordered before every participant's later releases.
void release_block_barrier(Block& b) {
  for (Thread& o : b.threads) {
    for (Store& st : o.pending) b.pending.push_back(std::move(st));
    o.pending.clear();
    for (BatchP& x : o.fenced) b.fenced.push_back(x);
    o.fenced.clear();
    if (o.state == State::kWaiting && o.wait == Wait::kBlock) o.state = State::kRunnable, o.wait = Wait::kNone;
  }
  b.block_arrived = 0;
}

void fiber_main() {
  Emu& e = emu();
#if defined(MOE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &e.sched_stack_bottom, &e.sched_stack_size);
#endif
  Thread* t = e.cur;
  t->blk->body(t->blk->ctx);
  Block& b = *t->blk;
  t->state = State::kDone;
  --b.live;
  // a warp collective that names this lane can no longer complete
  Warp& w = b.warps[t->linear / kWarp];
  for (int l = 0; l < kWarp; ++l)
    if (w.pending[l].in && (w.pending[l].mask >> (t->linear % kWarp) & 1u))
      fail_at(t, "a thread exited while its warp waits for it in a warp collective (mask names it)");
  // exited threads count as arrived at the block barrier
  if (b.block_arrived > 0 && b.block_arrived == b.live) release_block_barrier(b);
  switch_to_scheduler(true);
  std::abort();  // never resumed
}

#if defined(__x86_64__)
extern "C" void moe_emu_fiber_entry() { fiber_main(); }
#else
void fiber_entry_uc() { fiber_main(); }
#endif

char* new_stack() {
  Emu& e = emu();
  if (!e.free_stacks.empty()) {
    char* st = e.free_stacks.back();
    e.free_stacks.pop_back();
    return st;
  }
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
  e.blk = t.blk;
  t.polled = false;
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

// A new block of `dim` threads (stacks from the pool), ready to run.
std::unique_ptr<Block> make_block(dim3 grid, dim3 dim, size_t smem, uint3 idx, int device, long ordinal,
                                  void (*body)(void*), void* ctx) {
  auto bp = std::make_unique<Block>();
  Block& b = *bp;
  const int n = static_cast<int>(dim.x * dim.y * dim.z);
  b.grid = grid;
  b.dim = dim;
  b.idx = idx;
  b.device = device;
  b.ordinal = ordinal;
  b.body = body;
  b.ctx = ctx;
  b.nthreads = n;
  b.live = n;
  b.named_arrived.assign(16, 0);
  b.threads.assign(n, Thread{});
  b.warps.assign((n + kWarp - 1) / kWarp, Warp{});
  b.smem.assign(smem, 0xa5);  // garbage: dynamic shared memory starts undefined
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.linear = i;
    t.tid = uint3{static_cast<unsigned>(i % dim.x), static_cast<unsigned>(i / dim.x % dim.y),
                  static_cast<unsigned>(i / (dim.x * dim.y))};
    t.stack = new_stack();
    t.blk = &b;
    prepare(t);
  }
  return bp;
}

void free_block(Block& b) {
  for (Thread& t : b.threads) emu().free_stacks.push_back(t.stack);
}

std::string waiting_list(const std::vector<Block*>& blocks) {
  std::string msg;
  int shown = 0;
  for (const Block* b : blocks)
    for (const Thread& t : b->threads) {
      const bool polling = t.state == State::kRunnable && t.polled;
      if ((t.state != State::kWaiting && !polling) || shown >= 8) continue;
      ++shown;
      char where[160];
      std::snprintf(where, sizeof where, " device %d block (%u,%u,%u) t%d@%s", b->device, b->idx.x, b->idx.y,
                    b->idx.z, t.linear,
                    polling ? "signal wait" : t.wait == Wait::kBlock ? "__syncthreads"
                                              : t.wait == Wait::kNamed ? "bar.sync" : "warp collective");
      msg += where;
    }
  return msg;
}

void run_block(Block& b) {
  Emu& e = emu();
  const int n = b.nthreads;
  std::vector<int> order(n);
  for (;;) {
    order.clear();
    for (int i = 0; i < n; ++i)
      if (b.threads[i].state == State::kRunnable) order.push_back(i);
    if (order.empty()) break;
    if (e.order == 1) std::reverse(order.begin(), order.end());
    if (e.order == 2) std::shuffle(order.begin(), order.end(), e.rng);
    bool progress = false;
    for (int i : order) {
      if (b.threads[i].state != State::kRunnable) continue;
      resume(b.threads[i]);
      progress |= !(b.threads[i].state == State::kRunnable && b.threads[i].polled);
    }
    if (!progress) break;
  }
  if (b.live > 0) {
    e.blk = &b;
    fail_at(nullptr, ("deadlock: no thread can run; waiting:" + waiting_list({&b})).c_str());
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

void* dynamic_smem() {
  Block* b = emu().blk;
  return b == nullptr || b->smem.empty() ? nullptr : b->smem.data();
}

namespace {
void check_config(dim3 grid, dim3 block, size_t smem) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0)
    fail_at(nullptr, "invalid launch configuration (a GPU refuses it)");
  if (smem > 227 * 1024) fail_at(nullptr, "dynamic shared memory above 227 KiB");
}
std::vector<uint64_t> block_order(dim3 grid) {
  Emu& e = emu();
  const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> border(nblocks);
  for (uint64_t b = 0; b < nblocks; ++b) border[b] = b;
  if (e.order == 1) std::reverse(border.begin(), border.end());
  if (e.order == 2) std::shuffle(border.begin(), border.end(), e.rng);
  return border;
}
uint3 block_index(dim3 grid, uint64_t b) {
  return uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
               static_cast<unsigned>(b / (uint64_t(grid.x) * grid.y))};
}
}  // namespace

void run_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx) {
  Emu& e = emu();
  if (e.running) fail_at(nullptr, "a launch from device code");
  const long ordinal = e.launches++;
  if (e.trace)
    std::fprintf(stderr, "moe_emu: launch %ld grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n", ordinal, grid.x, grid.y,
                 grid.z, block.x, block.y, block.z, smem);
  check_config(grid, block, smem);
  e.running = true;
  for (uint64_t b : block_order(grid)) {
    std::unique_ptr<Block> blk = make_block(grid, block, smem, block_index(grid, b), e.device, ordinal, body, ctx);
    run_block(*blk);
    free_block(*blk);
  }
  e.blk = nullptr;
  e.running = false;
}

// ------------------------------------------------------------------------------------- multi-device mode --
bool multi_active() { return emu().multi; }

void multi_begin(int devices) {
  Emu& e = emu();
  if (e.multi || e.running) fail_at(nullptr, "multi_begin inside the multi-device mode or a launch");
  e.multi = true;
  e.device = 0;
  e.devices.clear();
  e.devices.resize(devices);
  e.carried.clear();
}

void set_device(int device) {
  Emu& e = emu();
  if (device < 0 || (e.multi && device >= static_cast<int>(e.devices.size())))
    fail_at(nullptr, "set_device: no such device");
  e.device = device;
}

void queue_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx, void (*destroy)(void*)) {
  Emu& e = emu();
  if (e.running) fail_at(nullptr, "a launch from device code");
  check_config(grid, block, smem);
  const long ordinal = e.launches++;
  if (e.trace)
    std::fprintf(stderr, "moe_emu: device %d launch %ld grid (%u,%u,%u) block (%u,%u,%u) smem %zu (queued)\n",
                 e.device, ordinal, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
  e.devices[e.device].queue.push_back(Queued{grid, block, smem, body, ctx, destroy, ordinal});
}

void multi_run() {
  Emu& e = emu();
  if (!e.multi) fail_at(nullptr, "multi_run without multi_begin");
  e.running = true;
  const int R = static_cast<int>(e.devices.size());
  // the start skew: under reverse the devices start one after the other from the last; under random every launch
  // starts after a random number of rounds (a device that is late shows a missing wait)
  for (int d = 0; d < R; ++d) e.devices[d].delay = e.order == 1 ? 3 * (R - 1 - d) : 0;
  std::vector<Thread*> order;
  std::vector<char> skip(R, 0);
  int idle_rounds = 0;
  for (long round = 0;; ++round) {
    bool progress = false, any = false;
    // the speed skew: under reverse device d runs every (1 + d % 3)-th round, under random each device sits out a
    // round with probability 1/3 (a device that is slow shows a missing wait, e.g. a buffer reused too early)
    for (int d = 0; d < R; ++d)
      skip[d] = e.order == 1 ? round % (1 + d % 3) != 0 : e.order == 2 ? e.rng() % 3 == 0 : 0;
    for (int d = 0; d < R; ++d) {
      Device& dev = e.devices[d];
      if (dev.busy || dev.next >= dev.queue.size()) continue;
      any = true;
      progress = true;
      if (dev.delay > 0) {
        --dev.delay;
        continue;
      }
      dev.cur = dev.queue[dev.next++];
      dev.busy = true;
      for (uint64_t b : block_order(dev.cur.grid))
        dev.blocks.push_back(make_block(dev.cur.grid, dev.cur.block, dev.cur.smem, block_index(dev.cur.grid, b), d,
                                        dev.cur.ordinal, dev.cur.body, dev.cur.ctx));
    }
    order.clear();
    for (int d = 0; d < R; ++d)
      for (auto& b : e.devices[d].blocks)
        for (Thread& t : b->threads)
          if (t.state == State::kRunnable) {
            any = true;
            if (!skip[d]) order.push_back(&t);
          }
    if (e.order == 1) std::reverse(order.begin(), order.end());
    if (e.order == 2) std::shuffle(order.begin(), order.end(), e.rng);
    for (Thread* t : order) {
      if (t->state != State::kRunnable) continue;
      any = true;
      resume(*t);
      progress |= !(t->state == State::kRunnable && t->polled);
    }
    for (int d = 0; d < R; ++d) {
      Device& dev = e.devices[d];
      if (!dev.busy) continue;
      any = true;
      bool done = true;
      for (auto& b : dev.blocks) done &= b->live == 0;
      if (!done) continue;
      // the launch ended: what it stored or released is ordered before the device's later releases
      for (auto& b : dev.blocks) {
        for (Thread& t : b->threads) {
          for (Store& st : t.pending) dev.pending.push_back(std::move(st));
          for (BatchP& x : t.fenced) dev.fenced.push_back(x);
        }
        for (Store& st : b->pending) dev.pending.push_back(std::move(st));
        for (BatchP& x : b->fenced) dev.fenced.push_back(x);
        free_block(*b);
      }
      dev.blocks.clear();
      dev.cur.destroy(dev.cur.ctx);
      dev.busy = false;
      dev.delay = e.order == 2 ? static_cast<int>(e.rng() % 6) : 0;
      progress = true;
    }
    e.blk = nullptr;
    if (!any) break;
    idle_rounds = progress ? 0 : idle_rounds + 1;
    if (idle_rounds > 64) {  // (no device sits out 64 rounds in a row but with probability 3^-64)
      std::vector<Block*> blocks;
      for (Device& dev : e.devices)
        for (auto& b : dev.blocks) blocks.push_back(b.get());
      const std::string msg = "deadlock: no thread of any device can make progress; waiting:" + waiting_list(blocks);
      fail_at(nullptr, msg.c_str());
    }
  }
  // stores never made visible stay poison: the next kernel on the destination may run at once (drop them)
  e.devices.clear();
  e.carried.clear();
  e.multi = false;
  e.running = false;
}

// ----------------------------------------------------------------------------------- cross-device memory --
namespace {
// The batch of `stores` (moved), appended to `into`; nothing when empty.
void batch_into(std::vector<Store>& stores, std::vector<BatchP>& into) {
  if (stores.empty()) return;
  auto b = std::make_shared<Batch>();
  b->stores = std::move(stores);
  stores.clear();
  into.push_back(std::move(b));
}
void apply(Batch& b) {
  if (b.applied) return;
  b.applied = true;
  for (const Store& st : b.stores) std::memcpy(st.dst, st.data.data(), st.data.size());
}
Thread* multi_thread(const char* what) {
  Emu& e = emu();
  if (e.cur == nullptr) fail_at(nullptr, what);
  return e.multi ? e.cur : nullptr;
}
}  // namespace

void tracked_store(void* dst, const void* src, size_t bytes) {
  Thread* t = multi_thread("a peer store outside a kernel");
  if (t == nullptr) {
    std::memcpy(dst, src, bytes);
    return;
  }
  Store st;
  st.dst = static_cast<unsigned char*>(dst);
  st.data.assign(static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + bytes);
  std::memset(dst, 0xff, bytes);  // poison until visible
  t->pending.push_back(std::move(st));
  yield();
}

void peer_read(void* dst, const void* src, size_t bytes) {
  Thread* t = multi_thread("a peer load outside a kernel");
  std::memcpy(dst, src, bytes);
  if (t != nullptr) yield();
}

void fence_system() {
  Thread* t = multi_thread("a system fence outside a kernel");
  if (t == nullptr || skipped(3)) return;
  Emu& e = emu();
  batch_into(t->pending, t->fenced);
  batch_into(t->blk->pending, t->blk->fenced);
  Device& dev = e.devices[t->blk->device];
  batch_into(dev.pending, dev.fenced);
}

void signal_write(uint64_t* p, uint64_t v, bool add, bool release) {
  Thread* t = multi_thread("a signal outside a kernel");
  if (t != nullptr) {
    if (release) fence_system();
    // the batches this thread's fences covered travel with the signal (those applied already need not)
    auto gone = [](const BatchP& b) { return b->applied; };
    std::erase_if(t->fenced, gone);
    std::erase_if(t->blk->fenced, gone);
    std::erase_if(emu().devices[t->blk->device].fenced, gone);
    std::vector<BatchP>& c = emu().carried[p];
    for (const BatchP& b : t->fenced) c.push_back(b);
    for (const BatchP& b : t->blk->fenced) c.push_back(b);
    for (const BatchP& b : emu().devices[t->blk->device].fenced) c.push_back(b);
  }
  *p = add ? *p + v : v;
  if (t != nullptr) yield();
}

uint64_t signal_read(const uint64_t* p, bool acquire) {
  Thread* t = multi_thread("a signal read outside a kernel");
  const uint64_t v = *p;
  if (t != nullptr && acquire) {
    auto it = emu().carried.find(p);
    if (it != emu().carried.end()) {
      for (const BatchP& b : it->second) apply(*b);
      it->second.clear();
    }
  }
  return v;
}

void wait_signal(const uint64_t* p, uint64_t target) {
  Thread* t = multi_thread("a signal wait outside a kernel");
  for (;;) {
    if (signal_read(p, true) >= target) return;
    if (t == nullptr) fail_at(emu().cur, "deadlock: a signal wait outside the multi-device mode never completes");
    t->polled = true;
    t->poll_addr = p;
    yield();
  }
}

int64_t fault_peer(int64_t peer, int64_t ranks) {
  if (emu().cur == nullptr) return peer;
  if (skipped(4)) return (peer + 1) % ranks;
  if (skipped(5)) return -1;
  return peer;
}

bool fault_unguarded() { return emu().cur != nullptr && skipped(6); }

void sync_block() {
  Emu& e = emu();
  Thread* t = e.cur;
  if (t == nullptr) fail_at(nullptr, "__syncthreads outside a kernel");
  if (skipped(0)) return;
  Block& b = *t->blk;
  t->state = State::kWaiting;
  t->wait = Wait::kBlock;
  if (++b.block_arrived == b.live) release_block_barrier(b);
  yield();
}

void named_barrier(int id, int count) {
  Emu& e = emu();
  Thread* t = e.cur;
  if (t == nullptr) fail_at(nullptr, "bar.sync outside a kernel");
  if (id < 0 || id >= 16) fail_at(t, "bar.sync id outside 0..15");
  Block& b = *t->blk;
  if (count <= 0 || count % kWarp != 0 || count > b.nthreads) fail_at(t, "bar.sync count not a multiple of 32");
  if (skipped(2)) return;
  t->state = State::kWaiting;
  t->wait = Wait::kNamed;
  t->named_id = id;
  if (++b.named_arrived[id] == count) {
    for (Thread& o : b.threads)
      if (o.state == State::kWaiting && o.wait == Wait::kNamed && o.named_id == id)
        o.state = State::kRunnable, o.wait = Wait::kNone;
    b.named_arrived[id] = 0;
  }
  yield();
}

uint64_t warp_op(Op op, unsigned mask, uint64_t value, int arg, int width) {
  Emu& e = emu();
  Thread* t = e.cur;
  if (t == nullptr) fail_at(nullptr, "a warp collective outside a kernel");
  if (op == Op::kSyncWarp && skipped(1)) return 0;
  Block& b = *t->blk;
  const int lane = t->linear % kWarp, base = t->linear - lane;
  Warp& w = b.warps[t->linear / kWarp];
  if (!(mask >> lane & 1u)) fail_at(t, "a warp collective whose mask does not name the calling lane");
  for (int l = 0; l < kWarp; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (base + l >= b.nthreads) fail_at(t, "a warp collective whose mask names a lane past the block's threads");
    if (b.threads[base + l].state == State::kDone) fail_at(t, "a warp collective whose mask names an exited lane");
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
      if (mask >> l & 1u) b.threads[base + l].result = complete_result(w, l, mask);
    for (int l = 0; l < kWarp; ++l) {
      if (!(mask >> l & 1u)) continue;
      w.pending[l].in = false;
      Thread& o = b.threads[base + l];
      o.state = State::kRunnable;
      o.wait = Wait::kNone;
    }
  }
  yield();
  return t->result;
}

}  // namespace moe_emu
