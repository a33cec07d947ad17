// SegmentCosts: validation, JSON, scaling, and the stage model (autoplan.h).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

#include "../util/json_fields.h"
#include "baton/autoplan.h"
#include "baton/error.h"

namespace baton {

namespace {

using nlohmann::json;

constexpr detail::JsonFields kFields{"segment costs", "segment costs JSON"};

SegmentCost parse_segment(const json& j, const std::string& path) {
  kFields.require_object(j, path);
  SegmentCost s;
  bool have_i = false;
  for (const auto& [key, val] : j.items()) {
    const std::string p = path + "." + key;
    if (key == "name") {
      if (!val.is_string())
        throw FormatError(
            fmt::format("segment costs JSON: '{}' must be a string (got {})", p, val.type_name()));
      s.name = val.get<std::string>();
    } else if (key == "f") {
      s.f = kFields.get_number(val, p);
    } else if (key == "b") {
      s.b = kFields.get_number(val, p);
    } else if (key == "i") {
      s.i = kFields.get_number(val, p);
      have_i = true;
    } else if (key == "w") {
      s.w = kFields.get_number(val, p);
    } else if (key == "overhead") {
      s.overhead = kFields.get_number(val, p);
    } else if (key == "update") {
      s.update = kFields.get_number(val, p);
    } else if (key == "update_comm") {
      s.update_comm = kFields.get_number(val, p);
    } else if (key == "min_recompute") {
      s.min_recompute = kFields.get_number(val, p);
    } else if (key == "act_bytes") {
      s.act_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "stash_bytes") {
      s.stash_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "min_stash_bytes") {
      s.min_stash_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "wstash_bytes") {
      s.wstash_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "full_stash_bytes") {
      s.full_stash_bytes = kFields.get_int(val, p, "an integer byte count");
      kFields.check_bytes(s.full_stash_bytes, p);
    } else if (key == "param_bytes") {
      s.param_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "opt_bytes") {
      s.opt_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "temp_bytes") {
      s.temp_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "min_transient_bytes") {
      s.min_transient_bytes = kFields.get_int(val, p, "an integer byte count");
    } else if (key == "full_transient_bytes") {
      s.full_transient_bytes = kFields.get_int(val, p, "an integer byte count");
    } else {
      throw FormatError(fmt::format(
          "segment costs JSON: unknown key '{}' (segment keys: name, f, b, i, w, overhead, "
          "update, act_bytes, stash_bytes, min_stash_bytes, min_recompute, wstash_bytes, "
          "full_stash_bytes, param_bytes, opt_bytes, temp_bytes, min_transient_bytes, "
          "full_transient_bytes)",
          p));
    }
  }
  if (!have_i) s.i = s.b;
  return s;
}

int64_t scale_bytes(int64_t v, double k) { return static_cast<int64_t>(std::llround(v * k)); }

}  // namespace

void SegmentCosts::validate() const {
  if (batch < 1)
    throw ConfigError(fmt::format("segment costs: batch must be >= 1 (got {})", batch));
  if (ref_microbatch < 1)
    throw ConfigError(
        fmt::format("segment costs: ref_microbatch must be >= 1 (got {})", ref_microbatch));
  kFields.check_time(link.latency, "link.latency");
  kFields.check_time(link.bandwidth, "link.bandwidth");
  if (!std::isfinite(fused_factor) || fused_factor <= 0)
    throw ConfigError(
        fmt::format("segment costs: fused_factor must be finite and > 0 (got {})", fused_factor));
  kFields.check_time(task_overhead, "task_overhead");
  kFields.check_time(step_overhead, "step_overhead");
  kFields.check_time(host_link_bandwidth, "host_link_bandwidth");
  if (segments.empty()) throw ConfigError("segment costs: 'segments' is empty");
  for (size_t k = 0; k < segments.size(); ++k) {
    const SegmentCost& s = segments[k];
    const std::string w = fmt::format("segments[{}]", k);
    kFields.check_time(s.f, w + ".f");
    kFields.check_time(s.b, w + ".b");
    kFields.check_time(s.i, w + ".i");
    kFields.check_time(s.w, w + ".w");
    kFields.check_time(s.overhead, w + ".overhead");
    kFields.check_time(s.update, w + ".update");
    kFields.check_time(s.update_comm, w + ".update_comm");
    if (s.update_comm > s.update)
      throw ConfigError(fmt::format("segment costs: {}.update_comm ({}) exceeds its update ({})", w,
                                    s.update_comm, s.update));
    kFields.check_time(s.min_recompute, w + ".min_recompute");
    kFields.check_bytes(s.act_bytes, w + ".act_bytes");
    kFields.check_bytes(s.stash_bytes, w + ".stash_bytes");
    kFields.check_bytes(s.min_stash_bytes, w + ".min_stash_bytes");
    kFields.check_bytes(s.wstash_bytes, w + ".wstash_bytes");
    kFields.check_bytes(s.param_bytes, w + ".param_bytes");
    kFields.check_bytes(s.opt_bytes, w + ".opt_bytes");
    kFields.check_bytes(s.temp_bytes, w + ".temp_bytes");
    kFields.check_bytes(s.min_transient_bytes, w + ".min_transient_bytes");
    kFields.check_bytes(s.full_transient_bytes, w + ".full_transient_bytes");
  }
}

SegmentCosts SegmentCosts::from_json(const std::string& text) {
  const json root = kFields.parse(text);
  kFields.require_object(root, "<root>");
  SegmentCosts c;
  bool have_segments = false;
  for (const auto& [key, val] : root.items()) {
    if (key == "batch") {
      c.batch = kFields.get_int(val, "batch", "an integer");
    } else if (key == "ref_microbatch") {
      c.ref_microbatch = kFields.get_int(val, "ref_microbatch", "an integer");
    } else if (key == "fused_factor") {
      c.fused_factor = kFields.get_number(val, "fused_factor");
    } else if (key == "task_overhead") {
      c.task_overhead = kFields.get_number(val, "task_overhead");
    } else if (key == "step_overhead") {
      c.step_overhead = kFields.get_number(val, "step_overhead");
    } else if (key == "link") {
      kFields.apply_link(val, c.link);
    } else if (key == "host_link_bandwidth") {
      c.host_link_bandwidth = kFields.get_number(val, "host_link_bandwidth");
    } else if (key == "segments") {
      if (!val.is_array())
        throw FormatError(fmt::format("segment costs JSON: 'segments' must be an array (got {})",
                                      val.type_name()));
      have_segments = true;
      c.segments.reserve(val.size());
      for (size_t k = 0; k < val.size(); ++k)
        c.segments.push_back(parse_segment(val[k], fmt::format("segments[{}]", k)));
    } else {
      throw FormatError(fmt::format(
          "segment costs JSON: unknown key '{}' (top-level keys: batch, ref_microbatch, link, "
          "host_link_bandwidth, fused_factor, task_overhead, step_overhead, segments)",
          key));
    }
  }
  if (!have_segments) throw FormatError("segment costs JSON: 'segments' is required");
  c.validate();
  return c;
}

std::array<double, 4> SegmentCosts::tasks_saved() const {
  std::array<double, 4> t{task_overhead, task_overhead, task_overhead, task_overhead};
  for (const SegmentCost& s : segments) {
    t[0] = std::min(t[0], s.f);
    t[1] = std::min(t[1], s.b);
    t[2] = std::min(t[2], s.i);
    t[3] = std::min(t[3], s.w);
  }
  for (double& v : t) v = std::max(v, 0.0);
  return t;
}

std::string SegmentCosts::to_json() const {
  json segs = json::array();
  for (const SegmentCost& s : segments) {
    json j{{"f", s.f},
           {"b", s.b},
           {"i", s.i},
           {"w", s.w},
           {"overhead", s.overhead},
           {"update", s.update},
           {"update_comm", s.update_comm},
           {"act_bytes", s.act_bytes},
           {"stash_bytes", s.stash_bytes},
           {"min_stash_bytes", s.min_stash_bytes},
           {"min_recompute", s.min_recompute},
           {"wstash_bytes", s.wstash_bytes},
           {"param_bytes", s.param_bytes},
           {"opt_bytes", s.opt_bytes},
           {"temp_bytes", s.temp_bytes}};
    if (!s.name.empty()) j["name"] = s.name;
    if (s.full_stash_bytes >= 0) j["full_stash_bytes"] = s.full_stash_bytes;
    if (s.min_transient_bytes > 0) j["min_transient_bytes"] = s.min_transient_bytes;
    if (s.full_transient_bytes > 0) j["full_transient_bytes"] = s.full_transient_bytes;
    segs.push_back(std::move(j));
  }
  json j{{"batch", batch},
         {"ref_microbatch", ref_microbatch},
         {"link", json{{"latency", link.latency}, {"bandwidth", link.bandwidth}}},
         {"fused_factor", fused_factor},
         {"task_overhead", task_overhead},
         {"step_overhead", step_overhead},
         {"host_link_bandwidth", host_link_bandwidth},
         {"segments", std::move(segs)}};
  return j.dump(2);
}

SegmentCosts SegmentCosts::scaled(int microbatches) const {
  if (microbatches < 1 || batch % microbatches != 0)
    throw ConfigError(
        fmt::format("segment costs: microbatches must divide batch (got batch={}, "
                    "microbatches={})",
                    batch, microbatches));
  const int64_t mb = batch / microbatches;
  const double k = static_cast<double>(mb) / static_cast<double>(ref_microbatch);
  SegmentCosts out = *this;
  out.ref_microbatch = mb;
  for (SegmentCost& s : out.segments) {
    const double o = s.overhead;
    auto t = [&](double v) { return std::min(v, o) + std::max(0.0, v - o) * k; };
    s.f = t(s.f);
    s.b = t(s.b);
    s.i = t(s.i);
    s.w = t(s.w);
    s.min_recompute *= k;
    s.act_bytes = scale_bytes(s.act_bytes, k);
    s.stash_bytes = scale_bytes(s.stash_bytes, k);
    s.min_stash_bytes = scale_bytes(s.min_stash_bytes, k);
    s.wstash_bytes = scale_bytes(s.wstash_bytes, k);
    if (s.full_stash_bytes >= 0) s.full_stash_bytes = scale_bytes(s.full_stash_bytes, k);
    s.temp_bytes = scale_bytes(s.temp_bytes, k);
    s.min_transient_bytes = scale_bytes(s.min_transient_bytes, k);
    s.full_transient_bytes = scale_bytes(s.full_transient_bytes, k);
  }
  return out;
}

const char* remat_name(Remat r) {
  switch (r) {
    case Remat::Keep:
      return "keep";
    case Remat::Min:
      return "min";
    case Remat::Full:
      return "full";
  }
  return "?";
}

Remat parse_remat(std::string_view name) {
  std::string n;
  for (char ch : name) n += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (n == "keep") return Remat::Keep;
  if (n == "min") return Remat::Min;
  if (n == "full") return Remat::Full;
  throw ConfigError(fmt::format("unknown remat mode '{}' (modes: keep, min, full)", name));
}

StageCost stage_cost(const SegmentCosts& c, int begin, int end, Remat remat) {
  const int n = static_cast<int>(c.segments.size());
  if (begin < 0 || end > n || begin >= end)
    throw ConfigError(
        fmt::format("stage [{}, {}) is not a non-empty range of the {} segments", begin, end, n));
  StageCost st;
  st.stash_bytes = st.wstash_bytes = st.wgrad_bytes = 0;
  int64_t min_stash = 0, full_stash = 0;
  bool per_layer = true;
  double rec = 0;
  const std::array<double, 4> saved = c.tasks_saved();
  const double merged = end - begin - 1;
  st.f = -merged * saved[0];
  st.b = -merged * saved[1];
  st.i = -merged * saved[2];
  st.w = -merged * saved[3];
  for (int k = begin; k < end; ++k) {
    const SegmentCost& s = c.segments[k];
    st.f += s.f;
    st.b += s.b;
    st.i += s.i;
    st.w += s.w;
    st.stash_bytes += s.stash_bytes;
    min_stash += s.min_stash_bytes;
    full_stash += s.full_stash_bytes;
    per_layer = per_layer && s.full_stash_bytes >= 0;
    rec += s.min_recompute;
    st.wstash_bytes += s.wstash_bytes;
    st.wgrad_bytes += s.param_bytes;
  }
  st.act_bytes = c.segments[end - 1].act_bytes;
  st.grad_bytes = begin > 0 ? c.segments[begin - 1].act_bytes : 0;
  st.fb = 0;
  switch (remat) {
    case Remat::Keep:
      break;
    case Remat::Min:
      st.stash_bytes = min_stash;
      st.b += rec;
      st.i += rec;
      break;
    case Remat::Full:
      st.stash_bytes = per_layer ? full_stash : st.grad_bytes;
      st.b += st.f;
      st.i += st.f;
      break;
  }
  return st;
}

int64_t stage_static_bytes(const SegmentCosts& c, int begin, int end) {
  int64_t v = 0;
  for (int k = begin; k < end; ++k) v += 2 * c.segments[k].param_bytes + c.segments[k].opt_bytes;
  return v;
}

std::vector<double> update_comm_exposed(const SegmentCosts& c, const std::vector<int>& cuts,
                                        const std::vector<int>& stage_rank, int ranks,
                                        int microbatches) {
  // Per rank, its stages in ascending order: overlapped communication and one
  // microbatch's backward.
  std::vector<std::vector<std::pair<double, double>>> per(static_cast<size_t>(ranks));
  const int n = static_cast<int>(c.segments.size());
  for (size_t s = 0; s < cuts.size(); ++s) {
    const int e = s + 1 < cuts.size() ? cuts[s + 1] : n;
    double comm = 0, back = 0;
    for (int k = cuts[s]; k < e; ++k) comm += c.segments[k].update_comm, back += c.segments[k].b;
    per[static_cast<size_t>(stage_rank[s])].emplace_back(comm, back);
  }
  const double group = std::max(1, std::min(microbatches, ranks));
  std::vector<double> out(static_cast<size_t>(ranks), 0.0);
  for (size_t r = 0; r < per.size(); ++r) {
    const auto& stages = per[r];
    std::vector<double> before(stages.size() + 1, 0.0);  // backward of the shallower stages
    for (size_t j = 0; j < stages.size(); ++j) before[j + 1] = before[j] + stages[j].second;
    // Deepest first: ready when its final group's backwards are done, before the end of
    // the rank's last backward by the shallower stages' share of the final group.
    double t = -std::numeric_limits<double>::infinity();
    for (size_t j = stages.size(); j-- > 0;)
      t = std::max(t, -group * before[j]) + stages[j].first;
    out[r] = std::max(0.0, t);
  }
  return out;
}

double update_time(const SegmentCosts& c, const std::vector<int>& cuts,
                   const std::vector<int>& stage_rank, int ranks, int microbatches) {
  std::vector<double> per(static_cast<size_t>(ranks), 0.0);
  const int n = static_cast<int>(c.segments.size());
  for (size_t s = 0; s < cuts.size(); ++s) {
    const int e = s + 1 < cuts.size() ? cuts[s + 1] : n;
    for (int k = cuts[s]; k < e; ++k)
      per[static_cast<size_t>(stage_rank[s])] += c.segments[k].update - c.segments[k].update_comm;
  }
  const std::vector<double> comm = update_comm_exposed(c, cuts, stage_rank, ranks, microbatches);
  for (size_t r = 0; r < per.size(); ++r) per[r] += comm[r];
  return c.step_overhead + (per.empty() ? 0.0 : *std::max_element(per.begin(), per.end()));
}

int64_t stage_temp_bytes(const SegmentCosts& c, int begin, int end, bool b_split) {
  int64_t v = 0;
  int64_t sums = 0;
  for (int k = begin; k < end; ++k) {
    v = std::max(v, c.segments[k].temp_bytes);
    sums += c.segments[k].param_bytes;
    if (b_split) sums += c.segments[k].wstash_bytes;
  }
  return v + sums;
}

int64_t stage_transient_bytes(const SegmentCosts& c, int begin, int end, Remat remat) {
  int64_t v = 0;
  for (int k = begin; k < end; ++k) {
    const SegmentCost& s = c.segments[k];
    if (remat == Remat::Min) v = std::max(v, s.min_transient_bytes);
    if (remat == Remat::Full) v = std::max(v, s.full_transient_bytes);
  }
  return v;
}

int64_t stage_update_bytes(const SegmentCosts& c, int begin, int end) {
  int64_t v = 0;
  for (int k = begin; k < end; ++k) v += c.segments[k].param_bytes + c.segments[k].opt_bytes;
  return v;
}

bool runs_b_as_i_then_w(const Schedule& s) {
  if (!s.split_backward()) return false;
  for (const auto& row : s.rank_actions)
    for (const auto& a : row)
      if (a.first.kind == TaskKind::B || (a.is_fused() && a.second.kind == TaskKind::B))
        return true;
  return false;
}

CostModel stage_cost_model(const SegmentCosts& c, const std::vector<int>& cuts,
                           const std::vector<Remat>& remat) {
  const int n = static_cast<int>(c.segments.size());
  if (cuts.empty() || cuts[0] != 0)
    throw ConfigError("stage cuts must start with 0 (stage 0 begins at segment 0)");
  if (remat.size() != cuts.size())
    throw ConfigError(fmt::format("{} remat modes for {} stages", remat.size(), cuts.size()));
  CostModel m;
  m.link = c.link;
  m.host_link_bandwidth = c.host_link_bandwidth;
  m.fused_factor = c.fused_factor;
  m.stages.reserve(cuts.size());
  for (size_t s = 0; s < cuts.size(); ++s) {
    const int e = s + 1 < cuts.size() ? cuts[s + 1] : n;
    m.stages.push_back(stage_cost(c, cuts[s], e, remat[s]));
  }
  return m;
}

int64_t parse_bytes(std::string_view text) {
  std::string t;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch))) t += ch;
  size_t k = 0;
  while (k < t.size() && (std::isdigit(static_cast<unsigned char>(t[k])) || t[k] == '.' ||
                          t[k] == 'e' || t[k] == 'E' || t[k] == '+' || t[k] == '-')) {
    // An 'e' followed by a non-digit starts a unit, not an exponent.
    if ((t[k] == 'e' || t[k] == 'E') &&
        (k + 1 >= t.size() || !(std::isdigit(static_cast<unsigned char>(t[k + 1])) ||
                                t[k + 1] == '+' || t[k + 1] == '-')))
      break;
    ++k;
  }
  const std::string num = t.substr(0, k);
  std::string unit;
  for (size_t j = k; j < t.size(); ++j)
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(t[j])));
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(num, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (num.empty() || used != num.size())
    throw ConfigError(fmt::format("cannot parse byte size '{}' (e.g. 20GiB, 512MB, 1e9)", text));
  double mul = 1;
  if (unit.empty() || unit == "b")
    mul = 1;
  else if (unit == "k" || unit == "kb")
    mul = 1e3;
  else if (unit == "m" || unit == "mb")
    mul = 1e6;
  else if (unit == "g" || unit == "gb")
    mul = 1e9;
  else if (unit == "t" || unit == "tb")
    mul = 1e12;
  else if (unit == "kib")
    mul = 1024.0;
  else if (unit == "mib")
    mul = 1024.0 * 1024;
  else if (unit == "gib")
    mul = 1024.0 * 1024 * 1024;
  else if (unit == "tib")
    mul = 1024.0 * 1024 * 1024 * 1024;
  else
    throw ConfigError(fmt::format(
        "cannot parse byte size '{}': unknown unit '{}' (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
        text, unit));
  const double bytes = v * mul;
  if (!std::isfinite(bytes) || bytes < 0 || bytes > 9.0e18)
    throw ConfigError(fmt::format("byte size '{}' is out of range", text));
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{}B", bytes);
  return fmt::format("{:.2f}{}", v, units[u]);
}

}  // namespace baton
