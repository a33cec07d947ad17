// Autoplan results as text: AutoplanResult::to_json and the table of
// autoplan_table (baton-plan --auto).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

#include "baton/autoplan.h"

namespace baton {

std::string AutoplanResult::to_json() const {
  using nlohmann::json;
  json rows = json::array();
  for (const PlanCandidate& p : plans) {
    json remat = json::array();
    for (Remat r : p.remat) remat.push_back(remat_name(r));
    json offload = json::array();
    for (Offload o : p.offload) offload.push_back(o == Offload::Stash ? "stash" : "none");
    rows.push_back(json{{"schedule", p.schedule},
                        {"virtual_stages", p.virtual_stages},
                        {"microbatches", p.microbatches},
                        {"cuts", p.cuts},
                        {"remat", remat},
                        {"step_time", p.step_time},
                        {"bubble_fraction", p.bubble_fraction},
                        {"peak_memory", p.peak_memory},
                        {"offload", offload},
                        {"peak_host", p.peak_host},
                        {"fits", p.fits}});
  }
  json s{{"configurations", stats.configurations},
         {"refused", stats.refused},
         {"partitions", stats.partitions},
         {"candidates", stats.candidates},
         {"simulated", stats.simulated},
         {"offloaded", stats.offloaded},
         {"pruned", stats.pruned},
         {"seconds", stats.seconds},
         {"exact", stats.exact},
         {"gap", stats.gap}};
  return json{{"plans", rows}, {"stats", s}}.dump(2);
}

std::string autoplan_table(const AutoplanResult& r, int64_t memory) {
  std::string out = fmt::format("{:>3}  {:<11} {:>2} {:>4} {:>12} {:>7} {:>11} {:>4}  {}  {}\n",
                                "#", "schedule", "v", "M", "step_time", "bubble", "max_peak",
                                "fits", "cuts", "remat / peak per rank");
  int k = 0;
  for (const PlanCandidate& p : r.plans) {
    std::string cuts, remat, peaks;
    for (size_t s = 0; s < p.cuts.size(); ++s) cuts += fmt::format("{}{}", s ? "," : "", p.cuts[s]);
    for (size_t s = 0; s < p.remat.size(); ++s) {
      const bool off = s < p.offload.size() && p.offload[s] == Offload::Stash;
      remat += fmt::format("{}{}{}", s ? "," : "", remat_name(p.remat[s]), off ? "+offload" : "");
    }
    for (size_t q = 0; q < p.peak_memory.size(); ++q)
      peaks += fmt::format("{}{}", q ? "," : "", format_bytes(p.peak_memory[q]));
    if (!p.peak_host.empty()) {
      peaks += " (host ";
      for (size_t q = 0; q < p.peak_host.size(); ++q)
        peaks += fmt::format("{}{}", q ? "," : "", format_bytes(p.peak_host[q]));
      peaks += ")";
    }
    out += fmt::format("{:>3}  {:<11} {:>2} {:>4} {:>12.6g} {:>6.1f}% {:>11} {:>4}  {}  {} / {}\n",
                       ++k, p.schedule, p.virtual_stages, p.microbatches, p.step_time,
                       100.0 * p.bubble_fraction, format_bytes(p.max_memory()),
                       p.fits ? "yes" : "no", cuts, remat, peaks);
  }
  const AutoplanStats& s = r.stats;
  out += fmt::format(
      "budget {} per rank; search: {} configurations ({} refused), {} partitions, {} candidates, "
      "{} simulated ({} with offloads), {} pruned, {:.3f} s, {}\n",
      memory > 0 ? format_bytes(memory) : std::string("unlimited"), s.configurations, s.refused,
      s.partitions, s.candidates, s.simulated, s.offloaded, s.pruned, s.seconds,
      s.exact ? std::string("exact")
              : fmt::format("approximate: certified within {:.2f}% of the optimum", 100 * s.gap));
  return out;
}

}  // namespace baton
