// Hardware: JSON reading/writing and validation (hardware.h).
#include "baton/hardware.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "../util/json_fields.h"
#include "baton/error.h"

namespace baton {

namespace {

using nlohmann::json;

constexpr detail::JsonFields kFields{"hardware", "hardware JSON"};

LinkSpec parse_link(const json& j, const std::string& path) {
  kFields.require_object(j, path);
  LinkSpec l;
  for (const auto& [key, val] : j.items()) {
    if (key == "bandwidth")
      l.bandwidth = kFields.get_number(val, path + ".bandwidth");
    else if (key == "latency")
      l.latency = kFields.get_number(val, path + ".latency");
    else
      throw FormatError(fmt::format(
          "hardware JSON: unknown key '{}.{}' (link keys: bandwidth, latency)", path, key));
  }
  return l;
}

std::string get_string(const json& j, const std::string& path) {
  if (!j.is_string())
    throw FormatError(
        fmt::format("hardware JSON: '{}' must be a string (got {})", path, j.type_name()));
  return j.get<std::string>();
}

void check_positive(double v, const std::string& field) {
  if (!std::isfinite(v) || v <= 0)
    throw ConfigError(fmt::format("hardware: {} must be finite and > 0 (got {})", field, v));
}

}  // namespace

double Hardware::achieved_flops(bool fp8) const {
  return (fp8 && peak_fp8 > 0 ? peak_fp8 : peak_bf16) * efficiency;
}

void Hardware::validate() const {
  if (gpus_per_node < 1)
    throw ConfigError(fmt::format("hardware: gpus_per_node must be >= 1 (got {})", gpus_per_node));
  check_positive(peak_bf16, "peak_bf16");
  kFields.check_time(peak_fp8, "peak_fp8");
  check_positive(hbm_bandwidth, "hbm_bandwidth");
  if (hbm_bytes <= 0)
    throw ConfigError(fmt::format("hardware: hbm_bytes must be > 0 (got {})", hbm_bytes));
  kFields.check_bytes(reserved_bytes, "reserved_bytes");
  if (reserved_bytes >= hbm_bytes)
    throw ConfigError(fmt::format("hardware: reserved_bytes ({}) must be < hbm_bytes ({})",
                                  reserved_bytes, hbm_bytes));
  check_positive(intra.bandwidth, "intra.bandwidth");
  kFields.check_time(intra.latency, "intra.latency");
  check_positive(inter.bandwidth, "inter.bandwidth");
  kFields.check_time(inter.latency, "inter.latency");
  if (!std::isfinite(efficiency) || efficiency <= 0 || efficiency > 1)
    throw ConfigError(
        fmt::format("hardware: efficiency must be in (0, 1] (got {})", efficiency));
}

Hardware Hardware::from_json(const std::string& text) {
  const json root = kFields.parse(text);
  kFields.require_object(root, "<root>");
  Hardware h;
  std::set<std::string> seen;
  for (const auto& [key, val] : root.items()) {
    seen.insert(key);
    if (key == "name") {
      h.name = get_string(val, key);
    } else if (key == "gpus_per_node") {
      h.gpus_per_node = static_cast<int>(kFields.get_int(val, key, "an integer"));
    } else if (key == "peak_bf16") {
      h.peak_bf16 = kFields.get_number(val, key);
    } else if (key == "peak_fp8") {
      h.peak_fp8 = kFields.get_number(val, key);
    } else if (key == "hbm_bandwidth") {
      h.hbm_bandwidth = kFields.get_number(val, key);
    } else if (key == "hbm_bytes") {
      h.hbm_bytes = kFields.get_int(val, key, "an integer byte count");
    } else if (key == "reserved_bytes") {
      h.reserved_bytes = kFields.get_int(val, key, "an integer byte count");
    } else if (key == "intra" || key == "inter") {
      (key == "intra" ? h.intra : h.inter) = parse_link(val, key);
    } else if (key == "efficiency") {
      h.efficiency = kFields.get_number(val, key);
    } else if (key == "efficiency_note") {
      h.efficiency_note = get_string(val, key);
    } else if (key == "sources") {
      kFields.require_object(val, "sources");
      for (const auto& [k, v] : val.items()) h.sources[k] = get_string(v, "sources." + k);
    } else {
      throw FormatError(fmt::format(
          "hardware JSON: unknown key '{}' (keys: name, gpus_per_node, peak_bf16, peak_fp8, "
          "hbm_bandwidth, hbm_bytes, reserved_bytes, intra, inter, efficiency, "
          "efficiency_note, sources)",
          key));
    }
  }
  for (const char* req :
       {"gpus_per_node", "peak_bf16", "hbm_bandwidth", "hbm_bytes", "intra", "inter"}) {
    if (!seen.count(req)) throw FormatError(fmt::format("hardware JSON: '{}' is required", req));
  }
  h.validate();
  return h;
}

std::string Hardware::to_json() const {
  json j;
  j["name"] = name;
  j["gpus_per_node"] = gpus_per_node;
  j["peak_bf16"] = peak_bf16;
  j["peak_fp8"] = peak_fp8;
  j["hbm_bandwidth"] = hbm_bandwidth;
  j["hbm_bytes"] = hbm_bytes;
  j["reserved_bytes"] = reserved_bytes;
  j["intra"] = {{"bandwidth", intra.bandwidth}, {"latency", intra.latency}};
  j["inter"] = {{"bandwidth", inter.bandwidth}, {"latency", inter.latency}};
  j["efficiency"] = efficiency;
  j["efficiency_note"] = efficiency_note;
  j["sources"] = sources;
  return j.dump(2);
}

}  // namespace baton
