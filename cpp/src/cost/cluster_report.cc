// A cluster search's result as JSON (ClusterResult::to_json) and as the table
// baton-plan --model prints (cluster_table).
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "baton/cluster.h"

namespace baton {

std::string ClusterResult::to_json() const {
  nlohmann::json plans_j = nlohmann::json::array();
  for (const ClusterPlan& p : plans) {
    std::vector<std::string> remat, offload;
    for (Remat r : p.plan.remat) remat.push_back(remat_name(r));
    for (Offload x : p.plan.offload) offload.push_back(x == Offload::Stash ? "stash" : "none");
    plans_j.push_back({{"pp", p.degrees.pp},
                       {"tp", p.degrees.tp},
                       {"dp", p.degrees.dp},
                       {"ep", p.degrees.ep},
                       {"fsdp", p.degrees.fsdp},
                       {"tp_overlap", p.degrees.tp_overlap},
                       {"dp_overlap", p.degrees.dp_overlap},
                       {"schedule", p.plan.schedule},
                       {"virtual_stages", p.plan.virtual_stages},
                       {"microbatches", p.plan.microbatches},
                       {"cuts", p.plan.cuts},
                       {"remat", remat},
                       {"offload", offload},
                       {"peak_host", p.plan.peak_host},
                       {"segment_names", p.segment_names},
                       {"segment_layers", p.segment_layers},
                       {"step_time", p.step_time},
                       {"tokens_per_second", p.tokens_per_second},
                       {"mfu", p.mfu},
                       {"tflops_per_gpu", p.tflops_per_gpu},
                       {"bubble", p.plan.bubble_fraction},
                       {"fits", p.plan.fits},
                       {"memory",
                        {{"params", p.memory.params},
                         {"grads", p.memory.grads},
                         {"optimizer", p.memory.optimizer},
                         {"activations", p.memory.activations},
                         {"total", p.memory.total},
                         {"host", p.memory.host}}},
                       {"time",
                        {{"gemm", p.time.gemm},
                         {"attention", p.time.attention},
                         {"memory", p.time.memory},
                         {"launch", p.time.launch},
                         {"recompute", p.time.recompute},
                         {"tp_comm", p.time.tp_comm},
                         {"ep_comm", p.time.ep_comm},
                         {"fsdp_comm", p.time.fsdp_comm},
                         {"dp_comm", p.time.dp_comm},
                         {"optimizer", p.time.optimizer},
                         {"bubble", p.time.bubble}}}});
  }
  nlohmann::json j{{"plans", plans_j},
                   {"stats",
                    {{"degree_tuples", stats.degree_tuples},
                     {"skipped_memory", stats.skipped_memory},
                     {"searched", stats.searched},
                     {"infeasible", stats.infeasible},
                     {"seconds", stats.seconds}}}};
  return j.dump(1);
}

std::string cluster_table(const ClusterResult& r, const Hardware& hw) {
  std::string out = fmt::format(
      "{:>3} {:>4} {:>3} {:>5} {:>3} {:>5} {:>7} {:>11} {:>2} {:>4} {:>9} {:>11} {:>6} {:>7} "
      "{:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
      "#", "pp", "tp", "dp", "ep", "fsdp", "overlap", "schedule", "v", "M", "step(s)", "tokens/s",
      "MFU",
      "bubble", "params", "grads", "optim", "activ", "total", "host");
  int k = 0;
  for (const ClusterPlan& p : r.plans) {
    // the host column: the most offloaded bytes any rank holds (not only the fullest GPU's)
    const int64_t host = p.plan.peak_host.empty()
                             ? 0
                             : *std::max_element(p.plan.peak_host.begin(), p.plan.peak_host.end());
    out += fmt::format(
        "{:>3} {:>4} {:>3} {:>5} {:>3} {:>5} {:>7} {:>11} {:>2} {:>4} {:>9.3f} {:>11.0f} "
        "{:>5.1f}% {:>6.1f}% {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        ++k, p.degrees.pp, p.degrees.tp, p.degrees.dp, p.degrees.ep, p.degrees.fsdp ? "yes" : "no",
        std::string(p.degrees.tp_overlap ? "tp" : "") +
            (p.degrees.tp_overlap && p.degrees.dp_overlap ? "+" : "") +
            (p.degrees.dp_overlap ? "dp" : (p.degrees.tp_overlap ? "" : "-")),
        p.plan.schedule, p.plan.virtual_stages, p.plan.microbatches, p.step_time,
        p.tokens_per_second, 100 * p.mfu, 100 * p.plan.bubble_fraction,
        format_bytes(p.memory.params), format_bytes(p.memory.grads),
        format_bytes(p.memory.optimizer), format_bytes(p.memory.activations),
        format_bytes(p.memory.total), host > 0 ? format_bytes(host) : "-");
  }
  out += fmt::format(
      "{} degree tuples, {} over memory by static bytes, {} searches ({} without a fit), "
      "{:.2f} s; memory budget {} per GPU ({}), MFU = model FLOPs / step time / (GPUs x {:.0f} "
      "TFLOP/s)\n",
      r.stats.degree_tuples, r.stats.skipped_memory, r.stats.searched, r.stats.infeasible,
      r.stats.seconds, format_bytes(hw.memory_budget()), hw.name, hw.peak_bf16 / 1e12);
  return out;
}

}  // namespace baton
