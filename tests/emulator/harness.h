// Test plumbing of the emulator harness (harness.cpp, harness_grouped.cpp): device-like buffers, outputs compared
// bit for bit, the schedule loop.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace emu_test {

extern bool g_full;  // --full: the whole matrix (larger shapes)

struct Rng {
  explicit Rng(uint64_t seed);
  int64_t uniform(int64_t lo, int64_t hi);  // inclusive
  double normal();
  bool bern(double p);
  std::mt19937_64 g;
};

// One output of a run: its bytes and the element size (for the report of the first difference).
struct Output {
  std::string name;
  size_t elem = 1;
  std::vector<unsigned char> bytes;
  // A floating-point sum whose order the kernel fixes differently from the CPU loop (a shuffle tree against a
  // column-order loop): 'f' / 'd' / 'b' (bf16) / 'h' (fp16) and a relative tolerance against the CPU; the emulated
  // runs must still agree with each other bit for bit under every schedule. 0: bit for bit against the CPU.
  char fp = 0;
  double rtol = 0;
  Output approx(char type, double tol) && {
    fp = type;
    rtol = tol;
    return std::move(*this);
  }
  template <class T>
  static Output of(const char* name, const T& v) {
    Output o{name, sizeof(T), std::vector<unsigned char>(sizeof(T))};
    std::memcpy(o.bytes.data(), &v, sizeof(T));
    return o;
  }
  template <class T>
  static Output of_vec(const char* name, const std::vector<T>& v) {
    Output o{name, sizeof(T), std::vector<unsigned char>(v.size() * sizeof(T))};
    if (!v.empty()) std::memcpy(o.bytes.data(), v.data(), o.bytes.size());
    return o;
  }
};

// A "device" allocation: exactly `bytes` of heap (AddressSanitizer flags any access past it), 64-byte aligned,
// filled with `fill` (a garbage pattern for outputs, so that an element a kernel forgets to write differs).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes, int fill = 0) : size_(bytes) {
    if (bytes > 0) {
      void* p = nullptr;
      if (posix_memalign(&p, 64, bytes) != 0) std::abort();
      data_ = static_cast<unsigned char*>(p);
      std::memset(data_, fill, bytes);
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
  }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~Buffer() { std::free(data_); }
  unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  template <class T>
  void put(int64_t i, T v) {
    std::memcpy(data_ + i * sizeof(T), &v, sizeof(T));
  }
  Output out(const char* name, size_t elem) const {
    Output o{name, elem, std::vector<unsigned char>(data_, data_ + size_)};
    return o;
  }

 private:
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// Runs `cpu` once and `gpu` (the emulated launcher) under every schedule of the run, comparing all outputs bit
// for bit; returns the number of emulated runs. Exits 1 at the first difference.
int run_case(const std::string& what, const std::function<std::vector<Output>()>& cpu,
             const std::function<std::vector<Output>()>& gpu);

int family_grouped();
int family_fp8_scaled();  // harness_scaled.cpp
int family_exchange();   // harness_exchange.cpp (the multi-device mode)
int family_permute_quantize();  // harness_permute_quantize.cpp

}  // namespace emu_test
