// CPU echo plan: plan_body with one thread, one group (the level-search and water-filling candidates run one after
// the other).
#include "reroute/echo_plan.h"

namespace moe_graph {
namespace echo_plan {

namespace {
struct HostCtx {
  int64_t tid = 0, nthreads = 1;
  bool group = true;
  int64_t gid = 0, ngroups = 1, nlevel_threads = 1;
  int64_t wid = 0, nwgroups = 1;
  int64_t lane = 0, nlanes = 1;
  void sync() {}
  void level_sync() {}
  void group_sync() {}
  Best group_best(Best b) { return b; }
};
}  // namespace

void plan_host(const PlanArgs& args) {
  if (args.R <= 0 || args.E <= 0 || args.k <= 0) return;
  HostCtx ctx;
  plan_body(args, ctx);
}

}  // namespace echo_plan
}  // namespace moe_graph
