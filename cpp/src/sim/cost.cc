// CostModel: lookup, validation and JSON (de)serialisation.
#include "baton/cost.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "../util/json_fields.h"
#include "baton/error.h"

namespace baton {

namespace {

using nlohmann::json;

constexpr detail::JsonFields kFields{"cost model", "cost JSON"};

void validate_stage(const StageCost& c, const std::string& where) {
  kFields.check_time(c.f, where + ".f");
  kFields.check_time(c.b, where + ".b");
  kFields.check_time(c.i, where + ".i");
  kFields.check_time(c.w, where + ".w");
  kFields.check_time(c.fb, where + ".fb");
  kFields.check_bytes(c.stash_bytes, where + ".stash_bytes");
  kFields.check_bytes(c.wstash_bytes, where + ".wstash_bytes");
  kFields.check_bytes(c.act_bytes, where + ".act_bytes");
  kFields.check_bytes(c.grad_bytes, where + ".grad_bytes");
  kFields.check_bytes(c.wgrad_bytes, where + ".wgrad_bytes");
}

// Applies the keys of `j` onto `c` (fields not mentioned keep their values).
void apply_stage(const json& j, const std::string& path, StageCost& c) {
  kFields.require_object(j, path);
  for (const auto& [key, val] : j.items()) {
    const std::string p = path + "." + key;
    if (key == "f")
      c.f = kFields.get_number(val, p);
    else if (key == "b")
      c.b = kFields.get_number(val, p);
    else if (key == "i")
      c.i = kFields.get_number(val, p);
    else if (key == "w")
      c.w = kFields.get_number(val, p);
    else if (key == "fb")
      c.fb = kFields.get_number(val, p);
    else if (key == "stash_bytes")
      c.stash_bytes = kFields.get_int(val, p, "an integer byte count");
    else if (key == "wstash_bytes")
      c.wstash_bytes = kFields.get_int(val, p, "an integer byte count");
    else if (key == "act_bytes")
      c.act_bytes = kFields.get_int(val, p, "an integer byte count");
    else if (key == "grad_bytes")
      c.grad_bytes = kFields.get_int(val, p, "an integer byte count");
    else if (key == "wgrad_bytes")
      c.wgrad_bytes = kFields.get_int(val, p, "an integer byte count");
    else
      throw FormatError(fmt::format(
          "cost JSON: unknown key '{}' (stage keys: f, b, i, w, fb, stash_bytes, wstash_bytes, "
          "act_bytes, grad_bytes, wgrad_bytes)",
          p));
  }
}

json stage_to_json(const StageCost& c) {
  return json{{"f", c.f},
              {"b", c.b},
              {"i", c.i},
              {"w", c.w},
              {"fb", c.fb},
              {"stash_bytes", c.stash_bytes},
              {"wstash_bytes", c.wstash_bytes},
              {"act_bytes", c.act_bytes},
              {"grad_bytes", c.grad_bytes},
              {"wgrad_bytes", c.wgrad_bytes}};
}

}  // namespace

const SkipCost& CostModel::skip(int from, int to) const {
  static const SkipCost kNone;
  for (const SkipCost& c : skips)
    if (c.from == from && c.to == to) return c;
  return kNone;
}

const StageCost& CostModel::stage(int s) const {
  if (s >= 0 && static_cast<size_t>(s) < stages.size()) return stages[s];
  return default_stage;
}

void CostModel::validate() const {
  validate_stage(default_stage, "default");
  for (size_t k = 0; k < stages.size(); ++k)
    validate_stage(stages[k], fmt::format("stages[{}]", k));
  for (size_t k = 0; k < skips.size(); ++k) {
    kFields.check_bytes(skips[k].act_bytes, fmt::format("skips[{}].act_bytes", k));
    kFields.check_bytes(skips[k].grad_bytes, fmt::format("skips[{}].grad_bytes", k));
  }
  kFields.check_time(link.latency, "link.latency");
  kFields.check_time(link.bandwidth, "link.bandwidth");
  kFields.check_time(host_link_bandwidth, "host_link_bandwidth");
  if (!std::isfinite(fused_factor) || fused_factor <= 0)
    throw ConfigError(
        fmt::format("cost model: fused_factor must be finite and > 0 (got {})", fused_factor));
}

CostModel CostModel::from_json(const std::string& text) {
  const json root = kFields.parse(text);
  kFields.require_object(root, "<root>");
  CostModel c;
  // "default" first: stage entries start from it.
  if (auto it = root.find("default"); it != root.end())
    apply_stage(*it, "default", c.default_stage);
  for (const auto& [key, val] : root.items()) {
    if (key == "default") continue;
    if (key == "stages") {
      if (!val.is_array())
        throw FormatError(
            fmt::format("cost JSON: 'stages' must be an array (got {})", val.type_name()));
      c.stages.reserve(val.size());
      for (size_t k = 0; k < val.size(); ++k) {
        StageCost s = c.default_stage;
        apply_stage(val[k], fmt::format("stages[{}]", k), s);
        c.stages.push_back(s);
      }
    } else if (key == "skips") {
      if (!val.is_array())
        throw FormatError(
            fmt::format("cost JSON: 'skips' must be an array (got {})", val.type_name()));
      for (size_t k = 0; k < val.size(); ++k) {
        const std::string path = fmt::format("skips[{}]", k);
        kFields.require_object(val[k], path);
        SkipCost e;
        for (const auto& [f, v] : val[k].items()) {
          const std::string p = path + "." + f;
          if (f == "from")
            e.from = static_cast<int32_t>(kFields.get_int(v, p, "a stage index"));
          else if (f == "to")
            e.to = static_cast<int32_t>(kFields.get_int(v, p, "a stage index"));
          else if (f == "act_bytes")
            e.act_bytes = kFields.get_int(v, p, "an integer byte count");
          else if (f == "grad_bytes")
            e.grad_bytes = kFields.get_int(v, p, "an integer byte count");
          else
            throw FormatError(fmt::format(
                "cost JSON: unknown key '{}' (skip keys: from, to, act_bytes, grad_bytes)", p));
        }
        c.skips.push_back(e);
      }
    } else if (key == "link") {
      kFields.apply_link(val, c.link);
    } else if (key == "host_link_bandwidth") {
      c.host_link_bandwidth = kFields.get_number(val, "host_link_bandwidth");
    } else if (key == "fused_factor") {
      c.fused_factor = kFields.get_number(val, "fused_factor");
    } else {
      throw FormatError(
          fmt::format("cost JSON: unknown key '{}' (top-level keys: default, stages, skips, link, "
                      "host_link_bandwidth, fused_factor)",
                      key));
    }
  }
  c.validate();
  return c;
}

std::string CostModel::to_json() const {
  json j;
  j["default"] = stage_to_json(default_stage);
  json arr = json::array();
  for (const auto& s : stages) arr.push_back(stage_to_json(s));
  j["stages"] = std::move(arr);
  if (!skips.empty()) {
    json sk = json::array();
    for (const auto& e : skips)
      sk.push_back(json{{"from", e.from},
                        {"to", e.to},
                        {"act_bytes", e.act_bytes},
                        {"grad_bytes", e.grad_bytes}});
    j["skips"] = std::move(sk);
  }
  j["link"] = json{{"latency", link.latency}, {"bandwidth", link.bandwidth}};
  j["host_link_bandwidth"] = host_link_bandwidth;
  j["fused_factor"] = fused_factor;
  return j.dump(2);
}

CostModel CostModel::uniform(double f, double b, double i, double w) {
  CostModel c;
  c.default_stage.f = f;
  c.default_stage.b = b;
  c.default_stage.i = i;
  c.default_stage.w = w;
  return c;
}

}  // namespace baton
