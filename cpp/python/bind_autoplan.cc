// Bindings of automatic planning (autoplan.h) and cluster planning (cluster.h,
// collectives.h): JSON texts in, plain dicts or JSON text out. Thin:
// conversion only.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "baton/autoplan.h"
#include "baton/cluster.h"
#include "baton/collectives.h"
#include "baton/error.h"
#include "baton/hardware.h"
#include "bind_planner.h"

namespace baton::python {

using namespace nb::literals;

namespace {

// Automatic planning: JSON in, plain dicts out (the Python side formats them).
nb::dict candidate_dict(const baton::PlanCandidate& p) {
  nb::dict d;
  d["schedule"] = p.schedule;
  d["virtual_stages"] = p.virtual_stages;
  d["microbatches"] = p.microbatches;
  d["cuts"] = p.cuts;
  std::vector<std::string> rm;
  for (baton::Remat x : p.remat) rm.emplace_back(baton::remat_name(x));
  d["remat"] = rm;
  d["step_time"] = p.step_time;
  d["bubble_fraction"] = p.bubble_fraction;
  d["peak_memory"] = p.peak_memory;
  std::vector<std::string> off;
  for (baton::Offload x : p.offload) off.emplace_back(x == baton::Offload::Stash ? "stash" : "none");
  d["offload"] = off;
  d["peak_host"] = p.peak_host;
  d["fits"] = p.fits;
  return d;
}

}  // namespace

void bind_autoplan(nb::module_& m) {
  m.def(
      "autoplan",
      [](const std::string& segments_json, int ranks, int64_t memory, int top,
         std::optional<std::vector<std::string>> families,
         std::optional<std::vector<int>> microbatches,
         std::optional<std::vector<std::string>> remat,
         std::optional<std::vector<int>> interleaved_v, int max_microbatches, double gap,
         int64_t node_budget, bool update_in_place, bool offload, int64_t host_memory,
         int32_t fetch_lookahead) {
        baton::SegmentCosts costs = baton::SegmentCosts::from_json(segments_json);
        baton::AutoplanOptions o;
        o.offload = offload;
        o.host_memory = host_memory;
        o.fetch_lookahead = fetch_lookahead;
        o.ranks = ranks;
        o.memory = memory;
        o.top = top;
        if (families) o.families = *families;
        if (microbatches) o.microbatches = *microbatches;
        if (remat)
          for (const auto& r : *remat) o.remat_modes.push_back(baton::parse_remat(r));
        if (interleaved_v) o.interleaved_v = *interleaved_v;
        o.max_microbatches = max_microbatches;
        o.gap = gap;
        o.node_budget = node_budget;
        o.update_in_place = update_in_place;
        baton::AutoplanResult r;
        {
          nb::gil_scoped_release release;
          r = baton::autoplan(costs, o);
        }
        nb::list plans;
        for (const baton::PlanCandidate& p : r.plans) plans.append(candidate_dict(p));
        nb::dict stats;
        stats["configurations"] = r.stats.configurations;
        stats["refused"] = r.stats.refused;
        stats["partitions"] = r.stats.partitions;
        stats["candidates"] = r.stats.candidates;
        stats["simulated"] = r.stats.simulated;
        stats["offloaded"] = r.stats.offloaded;
        stats["pruned"] = r.stats.pruned;
        stats["seconds"] = r.stats.seconds;
        stats["exact"] = r.stats.exact;
        stats["gap"] = r.stats.gap;
        return nb::make_tuple(plans, stats);
      },
      "segments_json"_a, "ranks"_a, "memory"_a = 0, "top"_a = 10, "families"_a = nb::none(),
      "microbatches"_a = nb::none(), "remat"_a = nb::none(), "interleaved_v"_a = nb::none(),
      "max_microbatches"_a = 0, "gap"_a = 0.0, "node_budget"_a = 20000, "update_in_place"_a = false,
      "offload"_a = false, "host_memory"_a = 0, "fetch_lookahead"_a = 1,
      "Searches stage cuts x schedule x microbatches x per-stage remat for the segment costs "
      "(JSON, autoplan.h). Returns (plans, stats): plans best first, each a dict with schedule, "
      "virtual_stages, microbatches, cuts, remat, step_time, bubble_fraction, peak_memory, "
      "offload (per stage 'none' or 'stash'), peak_host (per rank; empty: nothing offloaded), "
      "fits. offload: a candidate over the budget may offload its ranks' stashes to host memory "
      "(needs the costs' host_link_bandwidth) while its host bytes stay within host_memory per "
      "rank (0: unlimited). "
      "memory: bytes per rank (0: unlimited). node_budget: DFS nodes per configuration (0: no "
      "limit, exact); stats says whether the result is exact, else its certified gap. "
      "update_in_place: the update after the loop writes the new parameters and optimizer "
      "state in place (a donating step); otherwise they count beside the old ones. Raises "
      "ConfigError when nothing fits.");
  m.def(
      "autoplan_evaluate",
      [](const std::string& segments_json, const std::string& schedule, int ranks,
         int virtual_stages, int microbatches, const std::vector<int>& cuts,
         const std::vector<std::string>& remat, int64_t memory, bool update_in_place,
         const std::vector<std::string>& offload, int32_t fetch_lookahead) {
        baton::SegmentCosts costs = baton::SegmentCosts::from_json(segments_json);
        std::vector<baton::Remat> rm;
        for (const auto& r : remat) rm.push_back(baton::parse_remat(r));
        std::vector<baton::Offload> off;
        for (size_t s = 0; s < offload.size(); ++s) {
          if (offload[s] != "none" && offload[s] != "stash")
            throw baton::ConfigError(fmt::format(
                "offload[{}] is '{}'; a stage offloads 'none' or 'stash'", s, offload[s]));
          off.push_back(offload[s] == "stash" ? baton::Offload::Stash : baton::Offload::None);
        }
        return candidate_dict(baton::evaluate_candidate(costs, schedule, ranks, virtual_stages,
                                                        microbatches, cuts, rm, memory,
                                                        update_in_place, off, fetch_lookahead));
      },
      "segments_json"_a, "schedule"_a, "ranks"_a, "virtual_stages"_a, "microbatches"_a, "cuts"_a,
      "remat"_a, "memory"_a = 0, "update_in_place"_a = false,
      "offload"_a = std::vector<std::string>{}, "fetch_lookahead"_a = 1,
      "One candidate (given cuts and remat per stage) simulated: the dict autoplan returns.");
  m.def("parse_bytes", &baton::parse_bytes, "text"_a);
}

// Cluster planning (cluster.h): JSON texts in, the result's JSON text out.
void bind_cluster(nb::module_& m) {
  m.def(
      "hardware_normalize",
      [](const std::string& text) { return baton::Hardware::from_json(text).to_json(); }, "text"_a,
      "Parses and validates a hardware JSON; returns it with every field written.");
  m.def(
      "profile_normalize",
      [](const std::string& text) { return baton::ModelProfile::from_json(text).to_json(); },
      "text"_a, "Parses and validates a model profile JSON; returns it with every field written.");
  m.def(
      "plan_cluster",
      [](const std::string& profile, const std::string& hardware, int gpus, int64_t global_batch,
         bool fp8, const std::vector<int>& pp, const std::vector<int>& tp,
         const std::vector<int>& ep, int fsdp_mode, const std::vector<std::string>& families,
         int top, int max_segments, int max_microbatch_choices, double gap, int64_t node_budget,
         const std::vector<int>& interleaved_v, int tp_overlap, int dp_overlap,
         double grad_reduce_bytes, int offload, int32_t fetch_lookahead, double dispatch_bytes,
         int ep_node_limit, bool update_in_place, const std::string& attention_kernel,
         double stash_bytes) {
        baton::ClusterOptions o;
        o.stash_bytes = stash_bytes;
        o.dispatch_bytes = dispatch_bytes;
        o.ep_node_limit = ep_node_limit;
        o.update_in_place = update_in_place;
        o.attention_kernel = attention_kernel;
        o.offload = offload;
        o.fetch_lookahead = fetch_lookahead;
        o.tp_overlap = tp_overlap;
        o.dp_overlap = dp_overlap;
        o.grad_reduce_bytes = grad_reduce_bytes;
        o.gpus = gpus;
        o.global_batch = global_batch;
        o.fp8 = fp8;
        o.pp_choices = pp;
        o.tp_choices = tp;
        o.ep_choices = ep;
        o.fsdp_mode = fsdp_mode;
        o.families = families;
        o.top = top;
        o.max_segments = max_segments;
        o.max_microbatch_choices = max_microbatch_choices;
        o.gap = gap;
        o.node_budget = node_budget;
        if (!interleaved_v.empty()) o.interleaved_v = interleaved_v;
        nb::gil_scoped_release release;
        return baton::plan_cluster(baton::ModelProfile::from_json(profile),
                                   baton::Hardware::from_json(hardware), o)
            .to_json();
      },
      "profile"_a, "hardware"_a, "gpus"_a, "global_batch"_a, "fp8"_a = false,
      "pp"_a = std::vector<int>{}, "tp"_a = std::vector<int>{}, "ep"_a = std::vector<int>{},
      "fsdp_mode"_a = -1, "families"_a = std::vector<std::string>{}, "top"_a = 10,
      "max_segments"_a = 24, "max_microbatch_choices"_a = 1, "gap"_a = 0.02, "node_budget"_a = 500,
      "interleaved_v"_a = std::vector<int>{}, "tp_overlap"_a = -1, "dp_overlap"_a = -1,
      "grad_reduce_bytes"_a = 4.0, "offload"_a = -1, "fetch_lookahead"_a = 1,
      "dispatch_bytes"_a = 2.0, "ep_node_limit"_a = 0, "update_in_place"_a = true,
      "attention_kernel"_a = "", "stash_bytes"_a = 2.0,
      "Searches degrees x cuts x schedule x microbatches x remat x offload; returns the ranked "
      "result as JSON. offload: -1 searched when the hardware has a host_link, 0 never, 1 "
      "searched (refused without one). Raises ConfigError when nothing fits.");
  m.def(
      "evaluate_cluster",
      [](const std::string& profile, const std::string& hardware, int pp, int tp, int dp, int ep,
         bool fsdp, int64_t global_batch, bool fp8, const std::string& schedule, int virtual_stages,
         int microbatches, const std::string& remat, bool tp_overlap, bool dp_overlap,
         double grad_reduce_bytes, bool flash_attention, bool sequence_parallel,
         double dispatch_bytes, int ep_node_limit, bool update_in_place,
         const std::string& attention_kernel, double stash_bytes) {
        baton::ClusterOptions o;
        o.stash_bytes = stash_bytes;
        o.dispatch_bytes = dispatch_bytes;
        o.ep_node_limit = ep_node_limit;
        o.update_in_place = update_in_place;
        o.attention_kernel = attention_kernel;
        o.flash_attention = flash_attention;
        o.sequence_parallel = sequence_parallel;
        o.gpus = pp * tp * dp;
        o.global_batch = global_batch;
        o.fp8 = fp8;
        o.grad_reduce_bytes = grad_reduce_bytes;
        baton::ClusterResult r;
        r.plans.push_back(baton::evaluate_cluster(
            baton::ModelProfile::from_json(profile), baton::Hardware::from_json(hardware),
            baton::ClusterDegrees{pp, tp, dp, ep, fsdp, tp_overlap, dp_overlap}, o, schedule,
            virtual_stages, microbatches, baton::parse_remat(remat)));
        return r.to_json();
      },
      "profile"_a, "hardware"_a, "pp"_a, "tp"_a, "dp"_a, "ep"_a, "fsdp"_a, "global_batch"_a,
      "fp8"_a, "schedule"_a, "virtual_stages"_a, "microbatches"_a, "remat"_a,
      "tp_overlap"_a = false, "dp_overlap"_a = false, "grad_reduce_bytes"_a = 4.0,
      "flash_attention"_a = true, "sequence_parallel"_a = true, "dispatch_bytes"_a = 2.0,
      "ep_node_limit"_a = 0, "update_in_place"_a = true, "attention_kernel"_a = "",
      "stash_bytes"_a = 2.0,
      "One given configuration (even layer cuts, one remat mode) simulated; JSON like "
      "plan_cluster's with one plan.");
  m.def(
      "collective_time",
      [](const std::string& kind, double bytes, int n, double bandwidth, double latency) {
        const baton::LinkSpec l{bandwidth, latency};
        if (kind == "all_reduce") return baton::all_reduce_time(bytes, n, l);
        if (kind == "ring_all_reduce") return baton::ring_all_reduce_time(bytes, n, l);
        if (kind == "all_gather") return baton::all_gather_time(bytes, n, l);
        if (kind == "reduce_scatter") return baton::reduce_scatter_time(bytes, n, l);
        if (kind == "all_to_all") return baton::all_to_all_time(bytes, n, l);
        if (kind == "p2p") return baton::p2p_time(bytes, l);
        throw baton::ConfigError(fmt::format(
            "collective_time: unknown kind '{}' (all_reduce, ring_all_reduce, all_gather, "
            "reduce_scatter, all_to_all, p2p)",
            kind));
      },
      "kind"_a, "bytes"_a, "n"_a, "bandwidth"_a, "latency"_a,
      "Seconds of one collective (collectives.h formulas).");
}

}  // namespace baton::python
