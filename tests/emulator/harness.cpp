// Runs every custom CUDA kernel of csrc/ in the emulated CUDA execution model (moe_emu.h) through its host launcher
// (the *_cuda_launch / run_* functions, which choose the launch configurations) and compares every output, bit for
// bit, with the CPU implementation on the same inputs, under each schedule given.
//
//   harness <family> [--full] [--schedules forward,reverse,random:1]
//   families: activation permute dispatch receive reroute reroute_indices echo_plan grouped fp8_quantize fp8_scaled
//             exchange permute_quantize all
//
// Prints one line per family (cases x schedules compared); exits 1 at the first difference (naming the case, the
// schedule, the output and the first differing element), and aborts on what the emulator refuses (a deadlock,
// a warp collective whose lanes disagree, ...). Built with AddressSanitizer and UBSan by tests/test_emulator.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "activation/activation.h"
#include "common/error_flag.h"
#include "common/launch.cuh"
#include "fp8/quantize.h"
#include "harness.h"
#include "permute/dispatch_layout.h"
#include "permute/dispatch_layout_impl.h"
#include "permute/permute.h"
#include "reroute/echo_plan.h"
#include "reroute/reroute.h"

namespace emu_test {

namespace act = moe_graph::activation;

bool g_full = false;
std::vector<std::string> g_schedules;

Rng::Rng(uint64_t seed) : g(seed) {}
int64_t Rng::uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
double Rng::normal() { return std::normal_distribution<double>(0.0, 1.0)(g); }
bool Rng::bern(double p) { return std::bernoulli_distribution(p)(g); }

double value_of(const Output& o, size_t j) {
  const unsigned char* p = o.bytes.data() + j;
  switch (o.fp) {
    case 'd': { double v; std::memcpy(&v, p, 8); return v; }
    case 'f': { float v; std::memcpy(&v, p, 4); return v; }
    case 'b': { act::bf16_t v; std::memcpy(&v, p, 2); return act::widen(v); }
    default: { act::f16_t v; std::memcpy(&v, p, 2); return act::widen(v); }
  }
}

bool close(const Output& a, const Output& b, size_t j) {
  const double x = value_of(a, j), y = value_of(b, j);
  if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
  return std::fabs(x - y) <= a.rtol * (std::max(std::fabs(x), std::fabs(y)) + 1.0);  // relative, absolute near 0
}

// ref: the CPU's outputs (approx: within its tolerance) or an earlier emulated run's (exact: bit for bit)
void check_equal(const std::string& what, const std::vector<Output>& ref, const std::vector<Output>& got,
                 const std::string& schedule, bool exact) {
  if (ref.size() != got.size()) {
    std::printf("FAIL %s [%s]: %zu outputs against %zu\n", what.c_str(), schedule.c_str(), got.size(), ref.size());
    std::exit(1);
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    const Output& a = ref[i];
    const Output& b = got[i];
    if (a.bytes.size() != b.bytes.size() || a.elem != b.elem) {
      std::printf("FAIL %s [%s]: output %s has %zu bytes, the CPU's %zu\n", what.c_str(), schedule.c_str(),
                  a.name.c_str(), b.bytes.size(), a.bytes.size());
      std::exit(1);
    }
    for (size_t j = 0; j < a.bytes.size(); j += a.elem) {
      if (std::memcmp(a.bytes.data() + j, b.bytes.data() + j, a.elem) != 0 && (exact || !a.rtol || !close(a, b, j))) {
        uint64_t x = 0, y = 0;
        std::memcpy(&x, a.bytes.data() + j, std::min<size_t>(a.elem, 8));
        std::memcpy(&y, b.bytes.data() + j, std::min<size_t>(b.elem, 8));
        std::printf("FAIL %s [%s]: output %s differs first at element %zu (%s bits 0x%llx, emulated 0x%llx)\n",
                    what.c_str(), schedule.c_str(), a.name.c_str(), j / a.elem,
                    exact ? "first schedule's" : "CPU", (unsigned long long)x, (unsigned long long)y);
        std::exit(1);
      }
    }
  }
}

int run_case(const std::string& what, const std::function<std::vector<Output>()>& cpu,
             const std::function<std::vector<Output>()>& gpu) {
  const std::vector<Output> ref = cpu();
  std::vector<Output> first;
  for (const std::string& s : g_schedules) {
    if (!moe_emu::set_schedule(s.c_str())) {
      std::printf("bad schedule %s\n", s.c_str());
      std::exit(2);
    }
    std::vector<Output> got = gpu();
    check_equal(what, ref, got, s, false);
    if (first.empty()) first = std::move(got);
    else check_equal(what, first, got, s, true);
  }
  return static_cast<int>(g_schedules.size());
}

// ------------------------------------------------------------------------------------------------ activation --

size_t act_size(act::DType t) { return t == act::DType::kF64 ? 8 : t == act::DType::kF32 ? 4 : 2; }

// Random values of dtype t (bit patterns), rounded from normals.
Buffer act_values(Rng& rng, act::DType t, int64_t n, double scale = 1.0) {
  Buffer b(n * act_size(t));
  for (int64_t i = 0; i < n; ++i) {
    const double v = rng.normal() * scale;
    switch (t) {
      case act::DType::kF64: b.put<double>(i, v); break;
      case act::DType::kF32: b.put<float>(i, static_cast<float>(v)); break;
      case act::DType::kBF16: b.put<act::bf16_t>(i, act::Narrow<act::bf16_t>::to(static_cast<float>(v))); break;
      case act::DType::kF16: b.put<act::f16_t>(i, act::Narrow<act::f16_t>::to(static_cast<float>(v))); break;
    }
  }
  return b;
}

char fp_code(act::DType t) {
  return t == act::DType::kF64 ? 'd' : t == act::DType::kF32 ? 'f' : t == act::DType::kBF16 ? 'b' : 'h';
}
// a sum of a few hundred terms in another order: a few units in the last place of the accumulation type, and one
// rounding step of a 16-bit result
double sum_tol(act::DType t) {
  return t == act::DType::kF64 ? 1e-12 : t == act::DType::kF32 ? 1e-4 : t == act::DType::kBF16 ? 1e-2 : 2e-3;
}

int family_activation() {
  int runs = 0;
  Rng rng(11);
  std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 8}, {5, 0}, {1, 1}, {3, 3}, {7, 8}, {33, 24}, {40, 200},
                                                     {300, 16}, {2, 260}};
  if (g_full) shapes.insert(shapes.end(), {{1000, 64}, {130, 1000}, {4099, 8}});
  const act::DType dtypes[] = {act::DType::kF32, act::DType::kF64, act::DType::kBF16, act::DType::kF16};
  // every kind the op defines: the kinds dispatch_activation maps to a kernel of their own, probed from 0 up (a kind
  // added to the op is covered without a change here)
  std::vector<int> kinds;
  for (int k = 0; k < 64; ++k) {
    act::ActivationProblem probe;
    probe.kind = static_cast<act::ActKind>(k);
    bool own = false;
    act::dispatch_activation(probe, [&](auto kind, auto, auto) { own = static_cast<int>(decltype(kind)::value) == k; });
    if (!own) break;
    kinds.push_back(k);
  }
  int turn = 0;
  for (int kind : kinds) {
    for (act::DType dt : dtypes) {
      for (auto [rows, cols] : shapes) {
        // fp32 data: a scale in the data's dtype is the fp32 scale (the same kernel, the same case) but with --full
        const int modes = dt == act::DType::kF32 && !g_full ? 2 : 3;
        // the misaligned pointers (the one-element path, also taken aligned when cols is no multiple of the vector)
        // with one scale mode per kind, dtype and shape, in turn (every mode with --full)
        const int pick = (turn++ + kind) % modes;  // (+ kind: another shape meets each mode per kind)
        for (int scale_mode = 0; scale_mode < modes; ++scale_mode) {  // none, fp32, dtype
          for (int misalign = 0; misalign < 2; ++misalign) {
            if (misalign && (cols == 0 || rows == 0)) continue;
            if (misalign && !g_full && scale_mode != pick) continue;
            const int sms = static_cast<int>(rng.uniform(1, 3));
            const act::DType sdt = scale_mode == 2 ? dt : act::DType::kF32;
            const size_t es = act_size(dt);
            const int64_t off = misalign ? 1 : 0;  // one element in: pointers no longer 16-byte aligned
            const int64_t width = act::is_gated(static_cast<act::ActKind>(kind)) ? 2 * cols : cols;  // h's columns
            Buffer h = act_values(rng, dt, rows * width + off, 3.0);
            Buffer scale = act_values(rng, sdt, rows);
            Buffer dy = act_values(rng, dt, rows * cols + off);
            act::ActivationProblem p;
            p.rows = rows;
            p.cols = cols;
            p.dtype = dt;
            p.scale_dtype = sdt;
            p.kind = static_cast<act::ActKind>(kind);
            p.h = h.data() + off * es;
            p.scale = scale_mode ? scale.data() : nullptr;
            p.grad_y = dy.data() + off * es;
            p.sm_count = sms;
            const std::string what = "activation kind " + std::to_string(kind) + " dtype " +
                                     std::to_string(int(dt)) + " " + std::to_string(rows) + "x" +
                                     std::to_string(cols) + " scale " + std::to_string(scale_mode) +
                                     (misalign ? " misaligned" : "") + " sms " + std::to_string(sms);
            auto run = [&](bool emulate) {
              Buffer y(rows * cols * es + off * es, 0x5c), dh(rows * width * es + off * es, 0x5c),
                  ds(rows * act_size(sdt), 0x5c), ds_only(rows * act_size(sdt), 0x5c);
              act::ActivationProblem q = p;
              q.y = y.data() + off * es;
              q.grad_h = dh.data() + off * es;
              q.grad_scale = scale_mode ? ds.data() : nullptr;
              act::ActivationProblem q2 = q;  // the backward without grad_h: the scale gradient only
              q2.grad_h = nullptr;
              q2.grad_scale = scale_mode ? ds_only.data() : nullptr;
              if (emulate) {
                act::activation_forward_cuda(q, nullptr);
                act::activation_backward_cuda(q, nullptr);
                act::activation_backward_cuda(q2, nullptr);
              } else {
                act::activation_forward_rows(q, 0, rows);
                act::activation_backward_rows(q, 0, rows);
                act::activation_backward_rows(q2, 0, rows);
              }
              if (scale_mode && rows > 0 && std::memcmp(ds.data(), ds_only.data(), rows * act_size(sdt)) != 0) {
                std::printf("FAIL %s: the backward without grad_h gives another grad_scale (%s)\n", what.c_str(),
                            emulate ? "emulated" : "CPU");
                std::exit(1);
              }
              return std::vector<Output>{y.out("y", es), dh.out("grad_h", es),
                                         ds.out("grad_scale", act_size(sdt)).approx(fp_code(sdt), sum_tol(sdt))};
            };
            runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
          }
        }
      }
    }
  }
  return runs;
}

// --------------------------------------------------------------------------------------------------- permute --
namespace pm = moe_graph::permute;

int family_permute() {
  int runs = 0;
  Rng rng(12);
  struct Shape {
    int64_t n, K, m, H;
  };
  std::vector<Shape> shapes = {{0, 2, 0, 8}, {1, 1, 1, 1}, {5, 2, 12, 3}, {9, 3, 20, 8}, {33, 2, 70, 64},
                               {17, 4, 60, 520}, {70, 1, 64, 24}};
  if (g_full) shapes.insert(shapes.end(), {{600, 2, 1300, 128}, {64, 8, 700, 1040}});
  const pm::DType dtypes[] = {pm::DType::kFloat, pm::DType::kDouble, pm::DType::kBFloat16, pm::DType::kHalf};
  for (const Shape& s : shapes) {
    for (pm::DType dt : dtypes) {
      for (int variant = 0; variant < 3; ++variant) {  // 0 plain, 1 weights, 2 weights + a bad index + misaligned
        const size_t es = dt == pm::DType::kDouble ? 8 : dt == pm::DType::kFloat ? 4 : 2;
        const size_t acc = dt == pm::DType::kDouble ? 8 : 4;
        const int64_t off = variant == 2 ? 1 : 0;
        // a random partial injection of the n*K routes into the m rows; the rest point at the sentinels
        std::vector<int64_t> rows(s.m);
        for (int64_t i = 0; i < s.m; ++i) rows[i] = i;
        std::shuffle(rows.begin(), rows.end(), rng.g);
        Buffer route_rows((s.n * s.K) * 8), route_of_row(s.m * 8);
        for (int64_t i = 0; i < s.m; ++i) route_of_row.put<int64_t>(i, s.n * s.K);
        for (int64_t q = 0; q < s.n * s.K; ++q) {
          const bool placed = q < s.m && rng.bern(0.85);
          route_rows.put<int64_t>(q, placed ? rows[q] : s.m);
          if (placed) route_of_row.put<int64_t>(rows[q], q);
        }
        if (variant == 2 && s.n * s.K > 0) route_rows.put<int64_t>(rng.uniform(0, s.n * s.K - 1), s.m + 3);
        if (variant == 2 && s.m > 0) route_of_row.put<int64_t>(rng.uniform(0, s.m - 1), -2);
        auto values = [&](int64_t count) {
          Buffer b((count + off) * es);
          for (int64_t i = 0; i < count + off; ++i) {
            const float v = static_cast<float>(rng.normal());
            if (dt == pm::DType::kDouble) b.put<double>(i, rng.normal());
            else if (dt == pm::DType::kFloat) b.put<float>(i, v);
            else if (dt == pm::DType::kBFloat16) b.put<act::bf16_t>(i, act::Narrow<act::bf16_t>::to(v));
            else b.put<act::f16_t>(i, act::Narrow<act::f16_t>::to(v));
          }
          return b;
        };
        Buffer tok = values(s.n * s.H), rowd = values(s.m * s.H), w(s.n * s.K * acc);
        for (int64_t i = 0; i < s.n * s.K; ++i) {
          if (acc == 8) w.put<double>(i, rng.normal());
          else w.put<float>(i, static_cast<float>(rng.normal()));
        }
        for (pm::RouteOp op : {pm::RouteOp::kExpand, pm::RouteOp::kReduce, pm::RouteOp::kDot}) {
          pm::RouteProblem p;
          p.dtype = dt;
          p.tokens = s.n;
          p.topk = s.K;
          p.rows = s.m;
          p.hidden = s.H;
          p.token_data = tok.data() + off * es;
          p.row_data = rowd.data() + off * es;
          p.route_rows = reinterpret_cast<const int64_t*>(route_rows.data());
          p.route_of_row = reinterpret_cast<const int64_t*>(route_of_row.data());
          p.weights = variant && op != pm::RouteOp::kDot ? w.data() : nullptr;
          const int64_t out_elems = op == pm::RouteOp::kExpand ? s.m * s.H
                                    : op == pm::RouteOp::kReduce ? s.n * s.H
                                                                 : s.n * s.K;
          const size_t oes = op == pm::RouteOp::kDot ? acc : es;
          const std::string what = "permute op " + std::to_string(int(op)) + " dtype " + std::to_string(int(dt)) +
                                   " n" + std::to_string(s.n) + " K" + std::to_string(s.K) + " m" +
                                   std::to_string(s.m) + " H" + std::to_string(s.H) + " variant " +
                                   std::to_string(variant);
          auto run = [&](bool emulate) {
            Buffer out((out_elems + off) * oes, 0x5c);
            pm::RouteProblem q = p;
            q.out = out.data() + (op == pm::RouteOp::kDot ? 0 : off * oes);
            int32_t flag = 0;
            if (emulate) {
              pm::route_op_cuda_launch(op, q, &flag, nullptr);
            } else if (pm::route_op_host(op, q, 0, pm::output_rows(op, q)) >= 0) {
              flag = moe_graph::kErrIndexOutOfRange;
            }
            // route_dot: a shuffle tree over the lanes, not the CPU's element order
            Output o = out.out("out", oes);
            if (op == pm::RouteOp::kDot) o = std::move(o).approx(acc == 8 ? 'd' : 'f', acc == 8 ? 1e-12 : 1e-4);
            return std::vector<Output>{std::move(o), Output::of("error_flag", flag)};
          };
          runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
        }
      }
    }
  }
  return runs;
}

// ------------------------------------------------------------------------------------------ dispatch layout --
namespace dl = moe_graph::dispatch;

int family_dispatch() {
  int runs = 0;
  Rng rng(13);
  struct Shape {
    int64_t T, K, R, Lc, cap;
  };
  std::vector<Shape> shapes = {{0, 2, 2, 2, 4}, {1, 1, 1, 1, 1}, {5, 2, 2, 3, 3},   {40, 2, 4, 2, 12},
                               {100, 4, 8, 4, 30}, {300, 3, 3, 5, 1000}, {129, 2, 1, 8, 50}, {257, 1, 64, 2, 2},
                               {0, 2, 1, 3, 5}, {40, 3, 1, 5, 200}, {600, 2, 1, 6, 333}};
  if (g_full) shapes.insert(shapes.end(), {{2048, 8, 16, 8, 700}, {1500, 2, 256, 1, 8}, {4096, 8, 1, 32, 9000}});
  for (const Shape& s : shapes) {
   // aligned groups (align > 1) at R = 1 only, not in quota mode
   for (const int64_t align : s.R == 1 ? std::vector<int64_t>{1, 16, 3} : std::vector<int64_t>{1}) {
    // bit 0: route_order (probs policy); bit 1: valid mask; bit 2: quota mode (per-destination limits, packed slots)
    for (int variant = 0; variant < 8; ++variant) {
      if (align > 1 && (variant & 4)) continue;
      const int64_t n = s.T * s.K, C = s.R * s.Lc + 3;  // 3 extra columns: spare slots on random ranks
      std::vector<int64_t> col_rank(C), col_local(C), idx(n), order(n);
      for (int64_t c = 0; c < C; ++c) {
        col_rank[c] = c < s.R * s.Lc ? c / s.Lc : rng.uniform(0, s.R - 1);
        col_local[c] = c < s.R * s.Lc ? c % s.Lc : rng.uniform(0, s.Lc - 1);
      }
      std::vector<uint8_t> valid(n);
      for (int64_t r = 0; r < n; ++r) {
        // skewed: a third of the routes on the first columns
        idx[r] = rng.bern(0.3) ? rng.uniform(0, std::min<int64_t>(C - 1, 2)) : rng.uniform(0, C - 1);
        valid[r] = (variant & 2) ? rng.bern(0.8) : 1;
        order[r] = r;
      }
      std::shuffle(order.begin(), order.end(), rng.g);
      std::vector<int64_t> quota(s.R);
      for (int64_t d = 0; d < s.R; ++d) quota[d] = rng.bern(0.1) ? -1 : rng.uniform(0, std::max<int64_t>(1, 2 * n / s.R));
      const bool quota_mode = variant & 4;
      const std::string what = "dispatch_layout T" + std::to_string(s.T) + " K" + std::to_string(s.K) + " R" +
                               std::to_string(s.R) + " Lc" + std::to_string(s.Lc) + " cap" + std::to_string(s.cap) +
                               " align " + std::to_string(align) + " variant " + std::to_string(variant);
      auto run = [&](bool emulate) {
        const int64_t N = quota_mode ? n : s.R * dl::aligned_padded_rows(s.cap, s.Lc, align);
        std::vector<int64_t> route_slot(n, -7), route_of_slot(N, -7), send_counts(s.R * s.Lc, -7),
            aligned_counts(s.R * s.Lc, -7), column_counts(C, -7), dropped(1, -7), dropped_routes(1, 5),
            step_dropped(1, 2);
        std::vector<double> ratio(1, 0.25);
        dl::LayoutProblem p;
        p.num_routes = n;
        p.num_columns = C;
        p.num_ranks = s.R;
        p.num_local = s.Lc;
        p.capacity = s.cap;
        p.align = align;
        p.indices = idx.data();
        p.valid = (variant & 2) ? reinterpret_cast<const bool*>(valid.data()) : nullptr;
        p.column_rank = col_rank.data();
        p.column_local = col_local.data();
        p.route_order = (variant & 1) ? order.data() : nullptr;
        p.route_slot = route_slot.data();
        p.route_of_slot = route_of_slot.data();
        p.send_counts = send_counts.data();
        p.aligned_counts = aligned_counts.data();
        p.column_counts = column_counts.data();
        p.dropped = dropped.data();
        p.dropped_routes = dropped_routes.data();
        p.step_dropped_routes = step_dropped.data();
        p.step_max_load_ratio = ratio.data();
        p.dest_quota = quota_mode ? quota.data() : nullptr;
        int32_t flag = 0;
        if (emulate) {
          std::vector<int32_t> ws(dl::dispatch_layout_workspace_elems(n, s.R, s.Lc), -9);
          dl::dispatch_layout_cuda_launch(p, ws.data(), &flag, nullptr);
        } else if (dl::dispatch_layout_host(p).kind != dl::LayoutError::kNone) {
          std::printf("the CPU refused %s\n", what.c_str());
          std::exit(2);
        }
        return std::vector<Output>{Output::of_vec("route_slot", route_slot),
                                   Output::of_vec("route_of_slot", route_of_slot),
                                   Output::of_vec("send_counts", send_counts),
                                   Output::of_vec("aligned_counts", aligned_counts),
                                   Output::of_vec("column_counts", column_counts),
                                   Output::of_vec("dropped", dropped),
                                   Output::of_vec("dropped_routes", dropped_routes),
                                   Output::of_vec("step_dropped_routes", step_dropped),
                                   Output::of_vec("step_max_load_ratio", ratio),
                                   Output::of("error_flag", flag)};
      };
      runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
    }
   }
  }
  return runs;
}

int family_receive() {
  int runs = 0;
  Rng rng(14);
  struct Shape {
    int64_t R, Lc, cap;
  };
  std::vector<Shape> shapes = {{1, 1, 1}, {2, 3, 4}, {4, 2, 16}, {8, 5, 40}, {3, 300, 700}, {300, 2, 3}};
  if (g_full) shapes.insert(shapes.end(), {{64, 16, 300}, {256, 4, 64}});
  for (const Shape& s : shapes) {
   for (const int64_t align : {1, 16, 3}) {  // the groups' starts at multiples of align rows
    for (int variant = 0; variant < 2; ++variant) {  // 1: counts past the capacity (clamped, flagged)
      std::vector<int64_t> counts(s.R * s.Lc);
      for (int64_t src = 0; src < s.R; ++src) {
        int64_t left = s.cap;
        for (int64_t l = 0; l < s.Lc; ++l) {
          const int64_t c = variant ? rng.uniform(0, s.cap) : rng.uniform(0, left);
          counts[src * s.Lc + l] = c;
          left -= std::min(left, c);
        }
      }
      const std::string what = "receive_layout R" + std::to_string(s.R) + " Lc" + std::to_string(s.Lc) + " cap" +
                               std::to_string(s.cap) + " align " + std::to_string(align) + " variant " +
                               std::to_string(variant);
      const int64_t N = s.R * s.cap, P = dl::aligned_padded_rows(N, s.Lc, align);
      auto run = [&](bool emulate) {
        std::vector<int64_t> src(P, -7), target(N, -7), m_splits(s.Lc, -7), aligned(s.Lc, -7);
        dl::ReceiveProblem p;
        p.num_ranks = s.R;
        p.num_local = s.Lc;
        p.capacity = s.cap;
        p.recv_counts = counts.data();
        p.expert_row_source = src.data();
        p.recv_row_target = target.data();
        p.m_splits = m_splits.data();
        p.align = align;
        p.aligned_m_splits = aligned.data();
        int32_t flag = 0;
        if (emulate) {
          std::vector<int64_t> ws(dl::receive_layout_workspace_elems(s.R, s.Lc), -9);
          dl::receive_layout_cuda_launch(p, ws.data(), &flag, nullptr);
          flag &= ~moe_graph::kErrSplitsOverflow;  // the CPU refuses (reports) instead: compared below
        } else if (dl::receive_layout_host(p).kind != dl::LayoutError::kNone) {
          return std::vector<Output>{};  // refused: only the flag is compared
        }
        return std::vector<Output>{Output::of_vec("expert_row_source", src), Output::of_vec("recv_row_target", target),
                                   Output::of_vec("m_splits", m_splits), Output::of_vec("aligned_m_splits", aligned),
                                   Output::of("error_flag", flag)};
      };
      if (variant == 0) {
        runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
      } else {  // the clamped layout: no CPU result to compare with; the flag is set under every schedule
        for (const std::string& sch : g_schedules) {
          moe_emu::set_schedule(sch.c_str());
          std::vector<int64_t> src(P), target(N), m_splits(s.Lc), aligned(s.Lc),
              ws(dl::receive_layout_workspace_elems(s.R, s.Lc));
          dl::ReceiveProblem p{s.R, s.Lc, s.cap, counts.data(), src.data(), target.data(), m_splits.data(), align,
                               aligned.data()};
          int32_t flag = 0;
          dl::receive_layout_cuda_launch(p, ws.data(), &flag, nullptr);
          bool over = false;
          for (int64_t r = 0; r < s.R; ++r) {
            int64_t sum = 0;
            for (int64_t l = 0; l < s.Lc; ++l) sum += counts[r * s.Lc + l];
            over |= sum > s.cap;
          }
          if (over != ((flag & moe_graph::kErrSplitsOverflow) != 0)) {
            std::printf("FAIL %s [%s]: overflow flag %d, expected %d\n", what.c_str(), sch.c_str(), flag, over);
            std::exit(1);
          }
          ++runs;
        }
      }
    }
   }
  }
  return runs;
}

int family_aligned() {
  int runs = 0;
  Rng rng(15);
  struct Shape {
    int64_t G, rows, align;
  };
  std::vector<Shape> shapes = {{0, 7, 16}, {1, 0, 16}, {1, 40, 16}, {3, 10, 4}, {6, 42, 16}, {9, 300, 16},
                               {40, 1000, 32}, {5, 33, 1}};
  if (g_full) shapes.insert(shapes.end(), {{256, 20000, 16}, {1000, 4099, 128}});
  for (const Shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {  // 0 counts within rows, 1 past them (clamped), 2 negatives
      std::vector<int64_t> m(s.G);
      int64_t left = s.rows;
      for (int64_t g = 0; g < s.G; ++g) {
        const int64_t c = variant == 1 ? rng.uniform(0, s.rows / 2 + 2) : rng.uniform(0, left);
        m[g] = variant == 2 && g % 3 == 1 ? -c - 1 : c;
        left -= std::min(left, c);
      }
      const std::string what = "aligned_groups G" + std::to_string(s.G) + " rows" + std::to_string(s.rows) +
                               " align" + std::to_string(s.align) + " variant " + std::to_string(variant);
      auto run = [&](bool emulate) {
        const int64_t P = dl::aligned_padded_rows(s.rows, s.G, s.align);
        std::vector<int64_t> pm(s.G, -7), src(P, -7), tgt(s.rows, -7);
        const dl::AlignProblem p{s.G, s.rows, s.align, m.data(), pm.data(), src.data(), tgt.data()};
        if (emulate) {
          std::vector<int64_t> ws(std::max<int64_t>(1, dl::aligned_groups_workspace_elems(s.G)), -9);
          dl::aligned_groups_cuda_launch(p, ws.data(), nullptr);
        } else {
          dl::aligned_groups_host(p);
        }
        return std::vector<Output>{Output::of_vec("padded_m_splits", pm), Output::of_vec("source_of_padded", src),
                                   Output::of_vec("padded_of_source", tgt)};
      };
      runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
    }
  }
  return runs;
}

// ---------------------------------------------------------------------------------------------------- reroute --
namespace rr = moe_graph::reroute;

const rr::ParallelFor kSerial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  if (n > 0) body(0, n);
};

// An offload plan: each spare slot hosts a home expert (or none) and asks for some of its tokens.
void make_plan(Rng& rng, int64_t T, int64_t E, int64_t S, int bytes, bool over_ask, Buffer& map,
               std::vector<int64_t>& want) {
  map = Buffer(E * S * bytes, 0);
  want.assign(S, 0);
  for (int64_t j = 0; j < S; ++j) {
    if (rng.bern(0.2)) continue;  // unused slot
    const int64_t e = rng.bern(0.5) ? rng.uniform(0, std::min<int64_t>(E - 1, 2)) : rng.uniform(0, E - 1);
    if (bytes == 1) map.put<uint8_t>(e * S + j, 1);
    else if (bytes == 4) map.put<int32_t>(e * S + j, 1);
    else map.put<int64_t>(e * S + j, 1);
    want[j] = rng.uniform(0, over_ask ? T + 3 : std::max<int64_t>(T / 4, 1));
  }
}

int family_reroute() {
  int runs = 0;
  Rng rng(15);
  struct Shape {
    int64_t T, E, S;
  };
  std::vector<Shape> shapes = {{0, 4, 2}, {1, 1, 1}, {7, 5, 3}, {64, 8, 4}, {65, 40, 9}, {200, 300, 17},
                               {130, 16, 0}};
  if (g_full) shapes.insert(shapes.end(), {{1000, 64, 128}, {300, 520, 40}});
  for (const Shape& s : shapes) {
    for (int bytes : {1, 4, 8}) {
      for (int pbytes : {2, 4, 8}) {
        if (!g_full && bytes != 1 && pbytes != 4) continue;
        const bool over_ask = rng.bern(0.3);
        Buffer map;
        std::vector<int64_t> want;
        make_plan(rng, s.T, s.E, s.S, bytes, over_ask, map, want);
        std::vector<uint8_t> routing(s.T * s.E);
        Buffer probs(s.T * s.E * pbytes);
        for (int64_t i = 0; i < s.T * s.E; ++i) {
          routing[i] = rng.bern(0.3);
          for (int b = 0; b < pbytes; ++b) probs.data()[i * pbytes + b] = static_cast<unsigned char>(rng.uniform(0, 255));
        }
        const std::string what = "reroute_tokens T" + std::to_string(s.T) + " E" + std::to_string(s.E) + " S" +
                                 std::to_string(s.S) + " map bytes " + std::to_string(bytes) + " prob bytes " +
                                 std::to_string(pbytes);
        auto run = [&](bool emulate) {
          const int64_t W = s.E + s.S;
          Buffer out_map(s.T * W, 0x5c), out_probs(s.T * W * pbytes, 0x5c);
          int32_t flag = 0;
          rr::RerouteProblem p;
          p.num_tokens = s.T;
          p.num_experts = s.E;
          p.num_slots = s.S;
          p.routing_map = reinterpret_cast<const bool*>(routing.data());
          p.probs = probs.data();
          p.prob_bytes = pbytes;
          p.tokens_to_spare = want.data();
          p.offload_map = map.data();
          p.offload_bytes = bytes;
          p.out_map = reinterpret_cast<bool*>(out_map.data());
          p.out_probs = out_probs.data();
          p.error_flag = &flag;
          if (emulate) {
            std::vector<int32_t> ws(rr::reroute_workspace_elems(s.T, s.E, s.S), -9);
            rr::reroute_tokens_cuda_launch(p, ws.data(), nullptr);
          } else {
            rr::reroute_tokens_host(p, kSerial);
          }
          return std::vector<Output>{out_map.out("out_map", 1), out_probs.out("out_probs", pbytes),
                                     Output::of("error_flag", flag)};
        };
        runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
      }
    }
  }
  return runs;
}

int family_reroute_indices() {
  int runs = 0;
  Rng rng(16);
  struct Shape {
    int64_t T, K, E, S;
  };
  std::vector<Shape> shapes = {{0, 2, 4, 2}, {1, 1, 1, 1}, {7, 2, 5, 3}, {64, 4, 8, 4}, {65, 3, 40, 9},
                               {200, 8, 300, 17}, {130, 2, 16, 0}, {70, 1, 7, 5}};
  if (g_full) shapes.insert(shapes.end(), {{1000, 8, 64, 128}, {300, 2, 3000, 40}});
  for (const Shape& s : shapes) {
    for (int variant = 0; variant < 2; ++variant) {  // 1: valid mask, out-of-range experts, int32 offload map
      const int bytes = variant ? 4 : 1;
      Buffer map;
      std::vector<int64_t> want;
      make_plan(rng, s.T, s.E, s.S, bytes, rng.bern(0.3), map, want);
      std::vector<int64_t> idx(s.T * s.K);
      std::vector<uint8_t> valid(s.T * s.K);
      for (int64_t i = 0; i < s.T * s.K; ++i) {
        idx[i] = rng.bern(0.3) ? rng.uniform(0, std::min<int64_t>(s.E - 1, 2)) : rng.uniform(0, s.E - 1);
        if (variant && rng.bern(0.05)) idx[i] = rng.bern(0.5) ? -1 : s.E + s.S;
        valid[i] = variant ? rng.bern(0.85) : 1;
      }
      const std::string what = "reroute_indices T" + std::to_string(s.T) + " K" + std::to_string(s.K) + " E" +
                               std::to_string(s.E) + " S" + std::to_string(s.S) + " variant " +
                               std::to_string(variant);
      auto run = [&](bool emulate) {
        std::vector<int64_t> out(s.T * s.K, -7), home(s.S, -7);
        int32_t flag = 0;
        rr::RerouteIndexProblem p;
        p.num_tokens = s.T;
        p.topk = s.K;
        p.num_experts = s.E;
        p.num_slots = s.S;
        p.indices = idx.data();
        p.valid = variant ? reinterpret_cast<const bool*>(valid.data()) : nullptr;
        p.tokens_to_spare = want.data();
        p.offload_map = map.data();
        p.offload_bytes = bytes;
        p.out_indices = out.data();
        p.slot_home = home.data();
        p.error_flag = &flag;
        if (emulate) {
          std::vector<int32_t> ws(rr::reroute_workspace_elems(s.T, s.E, s.S), -9);
          rr::reroute_indices_cuda_launch(p, ws.data(), nullptr);
        } else {
          rr::reroute_indices_host(p, kSerial);
        }
        return std::vector<Output>{Output::of_vec("out_indices", out), Output::of_vec("slot_home", home),
                                   Output::of("error_flag", flag)};
      };
      runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
    }
  }
  return runs;
}

// -------------------------------------------------------------------------------------------------- echo plan --
namespace ep = moe_graph::echo_plan;

// Zipf-like counts [R, E]: every rank routes `tokens` tokens to topk experts of one shared popularity.
std::vector<int64_t> zipf_counts(Rng& rng, int64_t R, int64_t E, int64_t tokens, int64_t topk, double skew) {
  std::vector<double> p(E);
  for (int64_t e = 0; e < E; ++e) p[e] = 1.0 / std::pow(double(e + 1), skew);
  std::shuffle(p.begin(), p.end(), rng.g);
  std::discrete_distribution<int64_t> pick(p.begin(), p.end());
  std::vector<int64_t> c(R * E, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < tokens * std::min(topk, E); ++t) c[r * E + pick(rng.g)]++;
  return c;
}

int family_echo_plan() {
  int runs = 0;
  Rng rng(17);
  struct Case {
    int64_t R, E, k, w;  // w: donors per rank in a ring mask (0: unconstrained, R: every rank allowed)
    int mode;
  };
  std::vector<Case> cases = {{1, 8, 1, 0, 0},   {2, 8, 1, 0, 0},  {4, 16, 2, 0, 1}, {4, 16, 2, 0, 2},
                             {8, 64, 2, 2, 2},  {6, 42, 4, 2, 2}, {4, 4, 3, 0, 0},  {8, 64, 1, 8, 2},
                             {64, 256, 2, 0, 2}, {64, 256, 2, 32, 2}, {256, 256, 1, 8, 2}};
  if (g_full) cases.insert(cases.end(), {{64, 256, 1, 0, 0}, {16, 128, 2, 4, 2}, {256, 256, 1, 0, 2},
                                          {256, 512, 2, 128, 2}});
  for (const Case& c : cases) {
    std::vector<int64_t> counts = zipf_counts(rng, c.R, c.E, 256, 8, 1.2);
    if (c.E % 5 == 2) counts[0] = 0;
    std::vector<uint8_t> allowed(c.R * c.R, 0);
    for (int64_t r = 0; r < c.R; ++r)
      for (int64_t q = 0; q < c.R; ++q) {
        const int64_t d = (q - r + c.R) % c.R;
        allowed[r * c.R + q] = c.w >= c.R ? 1 : (d >= 1 && d <= c.w);
      }
    const int64_t S = c.R * c.k;
    const std::string what = "echo_plan R" + std::to_string(c.R) + " E" + std::to_string(c.E) + " k" +
                             std::to_string(c.k) + " w" + std::to_string(c.w) + " mode " + std::to_string(c.mode);
    auto run = [&](bool emulate) {
      std::vector<int64_t> h(c.E * S, -7), alloc(c.R * S, -7), ws(ep::plan_workspace_elems(c.R, c.E, c.k), -9);
      ep::PlanArgs a{counts.data(), c.R, c.E, c.k, c.mode,
                     c.w ? reinterpret_cast<const bool*>(allowed.data()) : nullptr, h.data(), alloc.data(),
                     ws.data()};
      if (emulate)
        ep::plan_cuda_launch(a, nullptr);
      else
        ep::plan_host(a);
      return std::vector<Output>{Output::of_vec("home_to_spare", h), Output::of_vec("allocation", alloc)};
    };
    runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
  }
  return runs;
}

// ------------------------------------------------------------------------------------------------ fp8 quantize --
namespace f8 = moe_graph::fp8;

int family_fp8_quantize() {
  int runs = 0;
  Rng rng(19);
  struct Tiles {
    int64_t tr, tc;
    bool mx, transpose;
  };
  // TE's recipes: 1x128 / 128x1 (transposed) / 128x128, MXFP8 1x32 / 32x1 (transposed), one scale per group
  const Tiles tiles[] = {{1, 128, false, false}, {128, 1, false, true}, {128, 128, false, false},
                         {1, 32, true, false},   {32, 1, true, true},   {0, 0, false, false}, {0, 0, false, true}};
  struct Shape {
    int64_t B, M, K, E;  // E > 0: m_splits (B == 1)
  };
  std::vector<Shape> shapes = {{1, 0, 128, 0}, {1, 1, 1, 0}, {1, 5, 130, 0}, {2, 33, 64, 0}, {1, 100, 160, 7},
                               {1, 64, 32, 1}};
  if (g_full)
    shapes.insert(shapes.end(), {{1, 257, 160, 7}, {1, 300, 96, 4}, {3, 129, 40, 0}, {1, 2000, 512, 16}, {4, 256, 384, 0}});
  int turn = 0;
  for (const Shape& s : shapes) {
    for (const Tiles& t : tiles) {
      const int pick = turn++ % 5;  // by default one input type per shape and tiling, in turn
      for (int in = 0; in < 5; ++in) {  // fp32, bf16, fp16, then FP8 with rowwise scales (1x128 fp32, 1x32 E8M0)
        if (!g_full && in != pick) continue;
        if (in >= 3 && s.B != 1) continue;  // an FP8 x is 2-D
        const int variant = static_cast<int>(rng.uniform(0, 2));  // 0 plain, 1 a negative split, 2 past M
        std::vector<int64_t> splits(s.E);
        for (int64_t g = 0; g < s.E; ++g) splits[g] = rng.bern(0.2) ? 0 : rng.uniform(0, std::max<int64_t>(1, s.M / s.E));
        if (s.E && variant == 1) splits[rng.uniform(0, s.E - 1)] = -2;
        if (s.E && variant == 2) splits[rng.uniform(0, s.E - 1)] += s.M;
        const bool i64 = rng.bern(0.5);
        Buffer sp(s.E * (i64 ? 8 : 4));
        for (int64_t g = 0; g < s.E; ++g) {
          if (i64) sp.put<int64_t>(g, splits[g]);
          else sp.put<int32_t>(g, static_cast<int32_t>(splits[g]));
        }
        const size_t es = in == 0 ? 4 : in >= 3 ? 1 : 2;
        Buffer x(s.B * s.M * s.K * es);
        for (int64_t i = 0; i < s.B * s.M * s.K; ++i) {
          float v = static_cast<float>(rng.normal() * (rng.bern(0.01) ? 1e4 : 3.0));
          if (rng.bern(0.003)) v = rng.bern(0.5) ? std::nanf("") : (rng.bern(0.5) ? 1.0f : -1.0f) * INFINITY;
          if (in == 0) x.put<float>(i, v);
          else if (in == 1) x.put<act::bf16_t>(i, act::Narrow<act::bf16_t>::to(v));
          else if (in == 2) x.put<act::f16_t>(i, act::Narrow<act::f16_t>::to(v));
          else {  // any byte, NaN (and E5M2 inf) codes rarely: NaN bytes and scales are canonical (docs/fp8.md)
            const uint8_t b = static_cast<uint8_t>(rng.uniform(0, 255));
            const uint8_t mag = b & 0x7F;
            const bool special = in == 3 ? mag == 0x7F : mag > 0x7B;
            x.put<uint8_t>(i, special && !rng.bern(0.05) ? static_cast<uint8_t>(b & 0xF0) : b);
          }
        }
        const int64_t xc = in == 3 ? 128 : 32, x_scale_cols = (s.K + xc - 1) / xc;
        Buffer xs(s.M * x_scale_cols * (in == 3 ? 4 : 1));
        for (int64_t i = 0; in >= 3 && i < s.M * x_scale_cols; ++i) {
          const int e = static_cast<int>(rng.uniform(-12, 12));
          if (in == 3) xs.put<float>(i, static_cast<float>(std::ldexp(1.0 + rng.normal() * 0.1, e)));
          else xs.put<uint8_t>(i, static_cast<uint8_t>(127 + e));
        }
        f8::QuantizeProblem p;
        p.batch = s.B;
        p.rows = s.M;
        p.cols = s.K;
        p.in_type = static_cast<f8::InType>(in);
        p.format = t.mx || rng.bern(0.5) ? f8::Format::kE4M3 : f8::Format::kE5M2;
        p.x = x.data();
        if (in >= 3) {
          p.x_scale = xs.data();
          p.x_scale_e8m0 = in == 4;
          p.x_scale_cols = x_scale_cols;
        }
        p.m_splits = s.E ? sp.data() : nullptr;
        p.splits_i64 = i64;
        p.groups = s.E;
        p.tile_rows = t.tr;
        p.tile_cols = t.tc;
        p.row_tiles = f8::row_tile_capacity(s.M, s.E, t.tr);
        p.col_tiles = t.tc == 0 ? 1 : (s.K + t.tc - 1) / t.tc;
        p.mx = t.mx;
        p.pow2 = rng.bern(0.3);
        p.eps = rng.bern(0.3) ? 1e-4f : 0.0f;
        p.transpose = t.transpose;
        const int64_t nscale = s.B * p.row_tiles * p.col_tiles;
        const size_t ses = t.mx ? 1 : 4;
        const std::string what = "fp8 quantize B" + std::to_string(s.B) + " M" + std::to_string(s.M) + " K" +
                                 std::to_string(s.K) + " E" + std::to_string(s.E) + " tiles " + std::to_string(t.tr) +
                                 "x" + std::to_string(t.tc) + (t.mx ? " mx" : "") + (t.transpose ? " transposed" : "") +
                                 " in " + std::to_string(in) + " variant " + std::to_string(variant);
        auto run = [&](bool emulate) {
          Buffer q(s.B * s.M * s.K, 0x5c), scale(nscale * ses, 0x5c);
          int32_t flag = 0, nonfinite = 0;
          f8::QuantizeProblem r = p;
          r.q = q.data();
          r.scale = scale.data();
          r.error_flag = &flag;
          r.nonfinite_flag = &nonfinite;
          if (emulate)
            f8::quantize_cuda(r, nullptr);
          else
            f8::quantize_cpu(r);
          return std::vector<Output>{q.out("q", 1), scale.out("scale", ses), Output::of("error_flag", flag),
                                     Output::of("nonfinite_flag", nonfinite)};
        };
        runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
      }
    }
  }
  // The fused producers: both copies (rowwise, transposed columnwise) of act(h) * s (forward) or of the activation
  // backward's grad_h for an output gradient g (backward: K = h's width) in one launch (quantize_pair_cuda) against
  // the CPU's two problems, for every activation kind and tiling, each h dtype in turn (all with --full), random
  // scale dtype.
  struct PairTiles {
    int64_t tr, tc, ctr, ctc;
    bool mx;
  };
  const PairTiles pairs[] = {{1, 128, 128, 1, false}, {1, 32, 32, 1, true}, {0, 0, 0, 0, false}};
  const act::DType hdts[] = {act::DType::kF32, act::DType::kBF16, act::DType::kF16};
  int pair_turn = 0;
  for (int grad = 0; grad < 2; ++grad)
  for (int kind = 0; kind <= static_cast<int>(act::ActKind::kGelu); ++kind) {
    for (const PairTiles& t : pairs) {
      const int pick = (pair_turn++ + kind + grad) % 3;  // by default one h dtype per direction, kind and tiling, in
                                                         // turn (each tiling meets every dtype over the kinds)
      for (int di = 0; di < 3; ++di) {
        if (!g_full && di != pick) continue;
        const act::DType dt = hdts[di];
        const int64_t M = g_full ? 300 : 37, F = g_full ? 160 : 40, E = 3;
        const bool gated = act::is_gated(static_cast<act::ActKind>(kind));
        const int64_t K = grad && gated ? 2 * F : F;  // the quantized width
        const int scale_mode = static_cast<int>(rng.uniform(0, 2));  // none, fp32, h's dtype
        const act::DType sdt = scale_mode == 2 ? dt : act::DType::kF32;
        Buffer h = act_values(rng, dt, M * (gated ? 2 * F : F), 3.0);
        if (rng.bern(0.3)) {  // a non-finite value now and then
          const int64_t i = rng.uniform(0, M * F - 1);
          if (dt == act::DType::kF32) h.put<float>(i, rng.bern(0.5) ? INFINITY : std::nanf(""));
          else h.put<uint16_t>(i, dt == act::DType::kBF16 ? 0x7F80 : 0x7C00);  // +inf
        }
        Buffer sc = act_values(rng, sdt, M);
        Buffer g = act_values(rng, dt, M * F, 2.0);  // the activation output's gradient (backward)
        std::vector<int64_t> splits(E);
        for (int64_t g = 0; g < E; ++g) splits[g] = rng.bern(0.2) ? 0 : rng.uniform(0, M / E + 3);
        Buffer sp(E * 8);
        for (int64_t g = 0; g < E; ++g) sp.put<int64_t>(g, splits[g]);
        f8::QuantizeProblem p0;
        p0.rows = M;
        p0.cols = K;
        p0.in_type = dt == act::DType::kF32 ? f8::InType::kF32 : dt == act::DType::kBF16 ? f8::InType::kBF16
                                                                                        : f8::InType::kF16;
        p0.format = t.mx || rng.bern(0.5) ? f8::Format::kE4M3 : f8::Format::kE5M2;
        p0.m_splits = sp.data();
        p0.splits_i64 = true;
        p0.groups = E;
        p0.mx = t.mx;
        p0.pow2 = rng.bern(0.5);
        p0.has_act = true;
        p0.act.rows = M;
        p0.act.cols = F;
        p0.act.dtype = dt;
        p0.act.scale_dtype = sdt;
        p0.act.kind = static_cast<act::ActKind>(kind);
        p0.act.h = h.data();
        p0.act.scale = scale_mode ? sc.data() : nullptr;
        p0.act_grad = grad == 1;
        p0.act.grad_y = grad ? g.data() : nullptr;
        f8::QuantizeProblem p1 = p0;
        p0.tile_rows = t.tr;
        p0.tile_cols = t.tc;
        p1.tile_rows = t.ctr;
        p1.tile_cols = t.ctc;
        p1.transpose = true;
        for (f8::QuantizeProblem* q : {&p0, &p1}) {
          q->row_tiles = f8::row_tile_capacity(M, E, q->tile_rows);
          q->col_tiles = q->tile_cols == 0 ? 1 : (K + q->tile_cols - 1) / q->tile_cols;
        }
        const size_t ses = t.mx ? 1 : 4;
        const std::string what = std::string(grad ? "fp8 fused activation backward pair" : "fp8 fused activation pair") +
                                 " kind " + std::to_string(kind) + " dtype " +
                                 std::to_string(static_cast<int>(dt)) + " tiles " + std::to_string(t.tr) + "x" +
                                 std::to_string(t.tc) + (t.mx ? " mx" : "") + " scale " + std::to_string(scale_mode);
        // the backward with a row scale and rowwise tiles of one row: the row-scale gradient in the same launch
        // (fp8::row_dot; the CPU sums in column order, the kernel in its own: expert_activation's tolerance)
        const bool ds_too = grad && scale_mode && t.tr == 1;
        const size_t dses = act_size(sdt);
        auto run = [&](bool emulate) {
          Buffer q0(M * K, 0x5c), q1(M * K, 0x5c), s0(p0.row_tiles * p0.col_tiles * ses, 0x5c),
              s1(p1.row_tiles * p1.col_tiles * ses, 0x5c), ds(M * dses, 0x5c);
          int32_t flag = 0, nonfinite = 0;
          f8::QuantizeProblem r0 = p0, r1 = p1;
          r0.act.grad_scale = ds_too ? ds.data() : nullptr;
          r0.q = q0.data();
          r0.scale = s0.data();
          r1.q = q1.data();
          r1.scale = s1.data();
          r0.error_flag = r1.error_flag = &flag;
          r0.nonfinite_flag = r1.nonfinite_flag = &nonfinite;
          if (emulate) {
            f8::quantize_pair_cuda(r0, &r1, nullptr);
          } else {
            f8::quantize_cpu(r0);
            f8::quantize_cpu(r1);
          }
          std::vector<Output> out{q0.out("q", 1), s0.out("scale", ses), q1.out("q_t", 1), s1.out("scale_t", ses),
                                  Output::of("error_flag", flag), Output::of("nonfinite_flag", nonfinite)};
          if (ds_too) out.push_back(ds.out("grad_scale", dses).approx(fp_code(sdt), sum_tol(sdt)));
          return out;
        };
        runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
      }
    }
  }
  return runs;
}

// ------------------------------------------------------------------- self-tests: what the emulator must catch --
__global__ void oob_kernel(int* out, int n) { out[blockIdx.x * blockDim.x + threadIdx.x] = n; }  // no bound check

__global__ void smem_oob_kernel(int* out) {
  int* s = moe_graph::dynamic_smem<int>();
  s[threadIdx.x] = static_cast<int>(threadIdx.x);  // one thread more than the dynamic shared memory holds
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

// Each thread reads its neighbour's shared value without a barrier between the write and the read.
__global__ void race_kernel(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = static_cast<int>(threadIdx.x) + 1;
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}

// Lanes of one warp in different collectives (divergent control flow around a shuffle).
__global__ void divergent_shfl_kernel(int* out) {
  const int v = static_cast<int>(threadIdx.x);
  out[threadIdx.x] = threadIdx.x < 16 ? __shfl_xor_sync(0xffffffffu, v, 1) : static_cast<int>(__ballot_sync(0xffffffffu, v));
}

int selftest_oob() {
  Buffer b(63 * sizeof(int));
  moe_graph::launch(oob_kernel, 2, 32, 0, nullptr, reinterpret_cast<int*>(b.data()), 1);
  return 1;
}

int selftest_smem_oob() {
  Buffer b(64 * sizeof(int));
  moe_graph::launch(smem_oob_kernel, 1, 64, 63 * sizeof(int), nullptr, reinterpret_cast<int*>(b.data()));
  return 1;
}

int selftest_race() {
  return run_case("race_kernel (no barrier between a shared write and a neighbour's read)",
                  [] {
                    std::vector<int> v(64);
                    for (int i = 0; i < 64; ++i) v[i] = (i + 1) % 64 + 1;
                    return std::vector<Output>{Output::of_vec("out", v)};
                  },
                  [] {
                    std::vector<int> v(64, -1);
                    moe_graph::launch(race_kernel, 1, 64, 0, nullptr, v.data());
                    return std::vector<Output>{Output::of_vec("out", v)};
                  });
}

int selftest_divergent_shfl() {
  std::vector<int> v(32);
  moe_graph::launch(divergent_shfl_kernel, 1, 32, 0, nullptr, v.data());
  return 1;
}

}  // namespace emu_test

int main(int argc, char** argv) {
  using namespace emu_test;
  std::string family = argc > 1 ? argv[1] : "all";
  std::string schedules = "forward,reverse,random:1";
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--full") g_full = true;
    else if (a == "--schedules" && i + 1 < argc) schedules = argv[++i];
    else {
      std::printf("unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  for (size_t b = 0; b <= schedules.size();) {
    size_t e = schedules.find(',', b);
    if (e == std::string::npos) e = schedules.size();
    g_schedules.push_back(schedules.substr(b, e - b));
    b = e + 1;
  }
  struct Family {
    const char* name;
    int (*run)();
  };
  const Family families[] = {{"activation", family_activation},         {"permute", family_permute},
                             {"dispatch", family_dispatch},             {"receive", family_receive},
                             {"aligned", family_aligned},
                             {"reroute", family_reroute},               {"reroute_indices", family_reroute_indices},
                             {"echo_plan", family_echo_plan},           {"grouped", family_grouped},
                             {"fp8_quantize", family_fp8_quantize},      {"fp8_scaled", family_fp8_scaled},
                             {"exchange", family_exchange},
                             {"permute_quantize", family_permute_quantize},
                             {"selftest_oob", selftest_oob},            {"selftest_smem_oob", selftest_smem_oob},
                             {"selftest_race", selftest_race},
                             {"selftest_divergent_shfl", selftest_divergent_shfl}};
  bool any = false;
  for (const Family& f : families) {
    if (family == "all" ? std::strncmp(f.name, "selftest", 8) == 0 : family != f.name) continue;
    any = true;
    const int runs = f.run();
    std::printf("ok %s: %d emulated runs equal to the CPU (schedules %s)\n", f.name, runs, schedules.c_str());
    std::fflush(stdout);
  }
  if (!any) {
    std::printf("unknown family %s\n", family.c_str());
    return 2;
  }
  return 0;
}
