// CostModel: lookup, validation and JSON (de)serialisation.
#include "baton/cost.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string_view>

#include "baton/error.h"

namespace baton {

namespace {

using nlohmann::json;

void check_time(double v, const std::string& field) {
  if (!std::isfinite(v) || v < 0)
    throw ConfigError(fmt::format("cost model: {} must be finite and >= 0 (got {})", field, v));
}

void check_bytes(int64_t v, const std::string& field) {
  if (v < 0) throw ConfigError(fmt::format("cost model: {} must be >= 0 (got {})", field, v));
}

void validate_stage(const StageCost& c, const std::string& where) {
  check_time(c.f, where + ".f");
  check_time(c.b, where + ".b");
  check_time(c.i, where + ".i");
  check_time(c.w, where + ".w");
  check_time(c.fb, where + ".fb");
  check_bytes(c.stash_bytes, where + ".stash_bytes");
  check_bytes(c.wstash_bytes, where + ".wstash_bytes");
  check_bytes(c.act_bytes, where + ".act_bytes");
  check_bytes(c.grad_bytes, where + ".grad_bytes");
  check_bytes(c.wgrad_bytes, where + ".wgrad_bytes");
}

const char* json_type(const json& j) { return j.type_name(); }

double get_number(const json& j, const std::string& path) {
  if (!j.is_number())
    throw FormatError(fmt::format("cost JSON: '{}' must be a number (got {})", path, json_type(j)));
  return j.get<double>();
}

int64_t get_bytes(const json& j, const std::string& path) {
  if (j.is_number_integer()) return j.get<int64_t>();
  if (j.is_number_float()) {
    double d = j.get<double>();
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e18)
      return static_cast<int64_t>(d);
    throw FormatError(
        fmt::format("cost JSON: '{}' must be an integer byte count (got {})", path, d));
  }
  throw FormatError(
      fmt::format("cost JSON: '{}' must be an integer byte count (got {})", path, json_type(j)));
}

void require_object(const json& j, const std::string& path) {
  if (!j.is_object())
    throw FormatError(
        fmt::format("cost JSON: '{}' must be an object (got {})", path, json_type(j)));
}

// Applies the keys of `j` onto `c` (fields not mentioned keep their values).
void apply_stage(const json& j, const std::string& path, StageCost& c) {
  require_object(j, path);
  for (const auto& [key, val] : j.items()) {
    const std::string p = path + "." + key;
    if (key == "f")
      c.f = get_number(val, p);
    else if (key == "b")
      c.b = get_number(val, p);
    else if (key == "i")
      c.i = get_number(val, p);
    else if (key == "w")
      c.w = get_number(val, p);
    else if (key == "fb")
      c.fb = get_number(val, p);
    else if (key == "stash_bytes")
      c.stash_bytes = get_bytes(val, p);
    else if (key == "wstash_bytes")
      c.wstash_bytes = get_bytes(val, p);
    else if (key == "act_bytes")
      c.act_bytes = get_bytes(val, p);
    else if (key == "grad_bytes")
      c.grad_bytes = get_bytes(val, p);
    else if (key == "wgrad_bytes")
      c.wgrad_bytes = get_bytes(val, p);
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

// 1-based line and column of byte offset `pos` (nlohmann reports the byte
// count read, i.e. one past the offending character).
std::pair<int, int> line_col(std::string_view text, size_t pos) {
  int line = 1, col = 1;
  if (pos > 0) pos -= 1;
  for (size_t k = 0; k < pos && k < text.size(); ++k) {
    if (text[k] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

}  // namespace

const StageCost& CostModel::stage(int s) const {
  if (s >= 0 && static_cast<size_t>(s) < stages.size()) return stages[s];
  return default_stage;
}

void CostModel::validate() const {
  validate_stage(default_stage, "default");
  for (size_t k = 0; k < stages.size(); ++k)
    validate_stage(stages[k], fmt::format("stages[{}]", k));
  check_time(link.latency, "link.latency");
  check_time(link.bandwidth, "link.bandwidth");
  if (!std::isfinite(fused_factor) || fused_factor <= 0)
    throw ConfigError(
        fmt::format("cost model: fused_factor must be finite and > 0 (got {})", fused_factor));
}

CostModel CostModel::from_json(const std::string& text) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    auto [line, col] = line_col(text, e.byte);
    std::string what = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    if (auto k = what.find("] "); k != std::string::npos) what = what.substr(k + 2);
    throw FormatError(line, col, "cost JSON: " + what);
  }
  require_object(root, "<root>");
  CostModel c;
  // "default" first: stage entries start from it.
  if (auto it = root.find("default"); it != root.end())
    apply_stage(*it, "default", c.default_stage);
  for (const auto& [key, val] : root.items()) {
    if (key == "default") continue;
    if (key == "stages") {
      if (!val.is_array())
        throw FormatError(
            fmt::format("cost JSON: 'stages' must be an array (got {})", json_type(val)));
      c.stages.reserve(val.size());
      for (size_t k = 0; k < val.size(); ++k) {
        StageCost s = c.default_stage;
        apply_stage(val[k], fmt::format("stages[{}]", k), s);
        c.stages.push_back(s);
      }
    } else if (key == "link") {
      require_object(val, "link");
      for (const auto& [lk, lv] : val.items()) {
        if (lk == "latency")
          c.link.latency = get_number(lv, "link.latency");
        else if (lk == "bandwidth")
          c.link.bandwidth = get_number(lv, "link.bandwidth");
        else
          throw FormatError(
              fmt::format("cost JSON: unknown key 'link.{}' (link keys: latency, bandwidth)", lk));
      }
    } else if (key == "fused_factor") {
      c.fused_factor = get_number(val, "fused_factor");
    } else {
      throw FormatError(fmt::format(
          "cost JSON: unknown key '{}' (top-level keys: default, stages, link, fused_factor)",
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
  j["link"] = json{{"latency", link.latency}, {"bandwidth", link.bandwidth}};
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
