// Hardware: JSON reading/writing and validation (hardware.h).
#include "baton/hardware.h"

#include <fmt/format.h>

#include <algorithm>
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
    else if (key == "bus_bandwidth")
      l.bus_bandwidth = kFields.get_number(val, path + ".bus_bandwidth");
    else
      throw FormatError(fmt::format(
          "hardware JSON: unknown key '{}.{}' (link keys: bandwidth, latency, bus_bandwidth)",
          path, key));
  }
  return l;
}

// [[x, y], ...]
RateTable parse_table(const json& j, const std::string& path) {
  if (!j.is_array())
    throw FormatError(fmt::format("hardware JSON: '{}' must be an array of [x, y] pairs (got {})",
                                  path, j.type_name()));
  RateTable t;
  for (size_t k = 0; k < j.size(); ++k) {
    const std::string p = fmt::format("{}[{}]", path, k);
    if (!j[k].is_array() || j[k].size() != 2)
      throw FormatError(fmt::format("hardware JSON: '{}' must be an [x, y] pair", p));
    t.points.emplace_back(kFields.get_number(j[k][0], p + "[0]"),
                          kFields.get_number(j[k][1], p + "[1]"));
  }
  return t;
}

json table_json(const RateTable& t) {
  json a = json::array();
  for (const auto& [x, y] : t.points) a.push_back({x, y});
  return a;
}

void check_table(const RateTable& t, const std::string& field) {
  for (size_t k = 0; k < t.points.size(); ++k) {
    const auto& [x, y] = t.points[k];
    if (!std::isfinite(x) || x <= 0 || !std::isfinite(y) || y <= 0)
      throw ConfigError(fmt::format("hardware: {}[{}] must be finite and > 0 (got [{}, {}])",
                                    field, k, x, y));
    if (k > 0 && x <= t.points[k - 1].first)
      throw ConfigError(fmt::format("hardware: {}[{}]: x must increase ({} after {})", field, k,
                                    x, t.points[k - 1].first));
  }
}

void check_fraction(double v, const std::string& field) {
  if (!std::isfinite(v) || v <= 0 || v > 1)
    throw ConfigError(fmt::format("hardware: {} must be in (0, 1] (got {})", field, v));
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

double RateTable::at(double x) const {
  if (points.empty()) return 0;
  double best = points.front().second;
  if (x <= points.front().first) return best;
  for (size_t k = 1; k < points.size(); ++k) {
    const auto& [x0, y0] = points[k - 1];
    const auto& [x1, y1] = points[k];
    const double lo = best;
    best = std::max(best, y1);
    if (x <= x1) {
      const double u = std::log(x / x0) / std::log(x1 / x0);
      return std::max(lo, y0 + u * (y1 - y0));
    }
  }
  return best;
}

double RateTable::rate_at(double x) const {
  if (points.empty()) return 0;
  double best = points.front().second;
  const double t_first = points.front().first / best;
  if (x <= points.front().first) return x / t_first;
  for (size_t k = 1; k < points.size(); ++k) {
    const double x0 = points[k - 1].first, x1 = points[k].first;
    const double y0 = best;
    best = std::max(best, points[k].second);
    if (x <= x1) {
      const double t0 = x0 / y0, t1 = x1 / best;
      const double u = std::log(x / x0) / std::log(x1 / x0);
      return x / std::exp(std::log(t0) + u * (std::log(t1) - std::log(t0)));
    }
  }
  return best;
}

double RateTable::max() const {
  double m = 0;
  for (const auto& p : points) m = std::max(m, p.second);
  return m;
}

double Hardware::achieved_flops(bool fp8) const {
  const bool f8 = fp8 && peak_fp8 > 0;
  if (!gemm_bf16.empty()) {
    if (f8)
      return (gemm_fp8.empty() ? gemm_bf16.max() * peak_fp8 / peak_bf16 : gemm_fp8.max()) *
             compute_scale();
    return gemm_bf16.max() * compute_scale();
  }
  return (f8 ? peak_fp8 : peak_bf16) * compute_scale();
}

double Hardware::memory_seconds(double bytes) const {
  return bytes / (hbm_bandwidth * hbm_efficiency);
}

double Hardware::wave_fraction(double rows, double cols, double calls) const {
  if (sms <= 0 || gemm_tiles.empty() || rows <= 0 || cols <= 0) return 1.0;
  const double c = std::max(1.0, calls);
  auto frac = [&](double tm, double tn) {
    const double tiles = std::ceil(rows / tm) * std::ceil(cols / tn) * c;
    return rows * cols * c / (tm * tn * sms * std::ceil(tiles / sms));
  };
  double best = 0;
  for (const auto& [tm, tn] : gemm_tiles) best = std::max({best, frac(tm, tn), frac(tn, tm)});
  return std::min(1.0, best);
}

double Hardware::gemm_seconds(double flops, double bytes, bool fp8, double rows, double cols,
                              double calls) const {
  if (flops <= 0) return 0;
  const bool f8 = fp8 && peak_fp8 > 0;
  double rate;
  if (gemm_bf16.empty())
    rate = (f8 ? peak_fp8 : peak_bf16) * compute_scale();
  else if (f8)
    rate = (gemm_fp8.empty() ? gemm_bf16.rate_at(flops) * peak_fp8 / peak_bf16
                             : gemm_fp8.rate_at(flops)) *
           compute_scale();
  else
    rate = gemm_bf16.rate_at(flops) * compute_scale();
  rate *= wave_fraction(rows, cols, calls);
  return std::max(flops / rate, memory_seconds(bytes));
}

AttentionCurve Hardware::attention_curve(const std::string& kernel) const {
  if (kernel.empty()) return {attention_fwd, attention_bwd_ratio};
  const auto it = attention_kernels.find(kernel);
  if (it != attention_kernels.end()) return it->second;
  std::string known;
  for (const auto& [k, v] : attention_kernels) known += (known.empty() ? "" : ", ") + k;
  throw ConfigError(fmt::format("hardware {}: no attention kernel '{}' (attention_kernels: {})",
                                name, kernel, known.empty() ? "none" : known));
}

double Hardware::attention_seconds(double flops, double seq, bool bwd,
                                   const std::string& kernel) const {
  const AttentionCurve a = attention_curve(kernel);
  if (flops <= 0) return 0;
  const double ratio = bwd ? a.bwd_ratio : 1.0;
  if (a.fwd.empty()) return flops / (peak_bf16 * compute_scale() * ratio);
  return flops / (peak_bf16 * a.fwd.at(seq) * ratio * compute_scale());
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
  if (sms < 0 || (sms > 0) != !gemm_tiles.empty())
    throw ConfigError(fmt::format(
        "hardware: wave_quantization needs sms >= 1 and at least one tile (got sms {}, {} tiles)",
        sms, gemm_tiles.size()));
  for (const auto& [tm, tn] : gemm_tiles)
    if (!std::isfinite(tm) || !std::isfinite(tn) || tm < 1 || tn < 1)
      throw ConfigError(fmt::format(
          "hardware: wave_quantization.tiles must be sizes >= 1 (got {} x {})", tm, tn));
  if (!std::isfinite(clock_ratio) || clock_ratio <= 0 || clock_ratio > 1)
    throw ConfigError(
        fmt::format("hardware: clock_ratio must be in (0, 1] (got {})", clock_ratio));
  kFields.check_time(intra.bus_bandwidth, "intra.bus_bandwidth");
  kFields.check_time(inter.bus_bandwidth, "inter.bus_bandwidth");
  if (intra.bus_bandwidth > intra.bandwidth)
    throw ConfigError(fmt::format("hardware: intra.bus_bandwidth ({}) exceeds intra.bandwidth ({})",
                                  intra.bus_bandwidth, intra.bandwidth));
  if (inter.bus_bandwidth > inter.bandwidth)
    throw ConfigError(fmt::format("hardware: inter.bus_bandwidth ({}) exceeds inter.bandwidth ({})",
                                  inter.bus_bandwidth, inter.bandwidth));
  kFields.check_bytes(host_bytes, "host_bytes");
  kFields.check_time(host_link.bandwidth, "host_link.bandwidth");
  kFields.check_time(host_link.latency, "host_link.latency");
  check_table(gemm_bf16, "gemm.bf16");
  check_table(gemm_fp8, "gemm.fp8");
  check_table(attention_fwd, "attention.fwd");
  // No measured rate above the datasheet peak.
  if (gemm_bf16.max() > peak_bf16)
    throw ConfigError(fmt::format("hardware: gemm.bf16 reaches {} FLOP/s, above peak_bf16 {}",
                                  gemm_bf16.max(), peak_bf16));
  if (gemm_fp8.max() > (peak_fp8 > 0 ? peak_fp8 : 0))
    throw ConfigError(fmt::format("hardware: gemm.fp8 reaches {} FLOP/s, above peak_fp8 {}",
                                  gemm_fp8.max(), peak_fp8));
  if (attention_fwd.max() > 1)
    throw ConfigError("hardware: attention.fwd fractions must be <= 1");
  check_fraction(attention_bwd_ratio, "attention.bwd_ratio");
  for (const auto& [k, a] : attention_kernels) {
    const std::string at = "attention_kernels." + k;
    check_table(a.fwd, at + ".fwd");
    if (a.fwd.empty() || a.fwd.max() > 1)
      throw ConfigError(fmt::format("hardware: {}.fwd must be fractions <= 1, at least one", at));
    check_fraction(a.bwd_ratio, at + ".bwd_ratio");
  }
  check_fraction(hbm_efficiency, "hbm_efficiency");
  kFields.check_time(kernel_overhead, "kernel_overhead");
  if (!std::isfinite(overlap_contention) || overlap_contention < 0 || overlap_contention >= 1)
    throw ConfigError(fmt::format("hardware: overlap_contention must be in [0, 1) (got {})",
                                  overlap_contention));
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
    } else if (key == "host_link") {
      h.host_link = parse_link(val, key);
    } else if (key == "host_bytes") {
      h.host_bytes = kFields.get_int(val, key, "an integer byte count");
    } else if (key == "gemm") {
      kFields.require_object(val, "gemm");
      for (const auto& [k, v] : val.items()) {
        if (k == "bf16")
          h.gemm_bf16 = parse_table(v, "gemm.bf16");
        else if (k == "fp8")
          h.gemm_fp8 = parse_table(v, "gemm.fp8");
        else
          throw FormatError(
              fmt::format("hardware JSON: unknown key 'gemm.{}' (gemm keys: bf16, fp8)", k));
      }
    } else if (key == "attention") {
      kFields.require_object(val, "attention");
      for (const auto& [k, v] : val.items()) {
        if (k == "fwd")
          h.attention_fwd = parse_table(v, "attention.fwd");
        else if (k == "bwd_ratio")
          h.attention_bwd_ratio = kFields.get_number(v, "attention.bwd_ratio");
        else
          throw FormatError(fmt::format(
              "hardware JSON: unknown key 'attention.{}' (attention keys: fwd, bwd_ratio)", k));
      }
    } else if (key == "attention_kernels") {
      kFields.require_object(val, "attention_kernels");
      for (const auto& [name, kv] : val.items()) {
        const std::string at = "attention_kernels." + name;
        kFields.require_object(kv, at);
        AttentionCurve a;
        for (const auto& [k, v] : kv.items()) {
          if (k == "fwd")
            a.fwd = parse_table(v, at + ".fwd");
          else if (k == "bwd_ratio")
            a.bwd_ratio = kFields.get_number(v, at + ".bwd_ratio");
          else
            throw FormatError(fmt::format(
                "hardware JSON: unknown key '{}.{}' (keys: fwd, bwd_ratio)", at, k));
        }
        h.attention_kernels[name] = a;
      }
    } else if (key == "hbm_efficiency") {
      h.hbm_efficiency = kFields.get_number(val, key);
    } else if (key == "kernel_overhead") {
      h.kernel_overhead = kFields.get_number(val, key);
    } else if (key == "overlap_contention") {
      h.overlap_contention = kFields.get_number(val, key);
    } else if (key == "wave_quantization") {
      kFields.require_object(val, "wave_quantization");
      for (const auto& [k, v] : val.items()) {
        if (k == "sms") {
          h.sms = static_cast<int>(kFields.get_int(v, "wave_quantization.sms", "an integer"));
        } else if (k == "tiles") {
          if (!v.is_array())
            throw FormatError(
                "hardware JSON: 'wave_quantization.tiles' must be a list of [rows, cols]");
          for (size_t i = 0; i < v.size(); ++i) {
            const std::string at = fmt::format("wave_quantization.tiles[{}]", i);
            if (!v[i].is_array() || v[i].size() != 2)
              throw FormatError(fmt::format("hardware JSON: '{}' must be [rows, cols]", at));
            h.gemm_tiles.emplace_back(kFields.get_number(v[i][0], at + "[0]"),
                                      kFields.get_number(v[i][1], at + "[1]"));
          }
        } else {
          throw FormatError(fmt::format(
              "hardware JSON: unknown key 'wave_quantization.{}' (keys: sms, tiles)", k));
        }
      }
    } else if (key == "clock_ratio") {
      h.clock_ratio = kFields.get_number(val, key);
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
          "hbm_bandwidth, hbm_bytes, reserved_bytes, intra, inter, host_link, host_bytes, gemm, "
          "attention, attention_kernels, "
          "hbm_efficiency, kernel_overhead, overlap_contention, wave_quantization, clock_ratio, "
          "efficiency, "
          "efficiency_note, "
          "sources)",
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
  auto link = [](const LinkSpec& l) {
    return json{{"bandwidth", l.bandwidth}, {"latency", l.latency},
                {"bus_bandwidth", l.bus_bandwidth}};
  };
  j["intra"] = link(intra);
  j["inter"] = link(inter);
  if (host_link.bandwidth > 0 || host_link.latency > 0) j["host_link"] = link(host_link);
  if (host_bytes > 0) j["host_bytes"] = host_bytes;
  j["gemm"] = {{"bf16", table_json(gemm_bf16)}, {"fp8", table_json(gemm_fp8)}};
  j["attention"] = {{"fwd", table_json(attention_fwd)}, {"bwd_ratio", attention_bwd_ratio}};
  for (const auto& [k, a] : attention_kernels)
    j["attention_kernels"][k] = {{"fwd", table_json(a.fwd)}, {"bwd_ratio", a.bwd_ratio}};
  j["hbm_efficiency"] = hbm_efficiency;
  j["kernel_overhead"] = kernel_overhead;
  j["overlap_contention"] = overlap_contention;
  if (sms > 0) {
    json tiles = json::array();
    for (const auto& [tm, tn] : gemm_tiles) tiles.push_back({tm, tn});
    j["wave_quantization"] = {{"sms", sms}, {"tiles", tiles}};
  }
  j["clock_ratio"] = clock_ratio;
  j["efficiency"] = efficiency;
  j["efficiency_note"] = efficiency_note;
  j["sources"] = sources;
  return j.dump(2);
}

}  // namespace baton
