// Internal (not installed): field checks and typed JSON getters shared by the
// JSON readers of CostModel (sim/cost.cc) and SegmentCosts
// (autoplan/segments.cc). Errors name the structure they come from through
// the prefixes of a JsonFields, e.g. "cost model: stages[3].f must be ..." or
// "segment costs JSON: 'segments[0].f' must be a number ...".
#pragma once
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "baton/cost.h"
#include "baton/error.h"

namespace baton::detail {

// 1-based line and column of byte offset `pos` (nlohmann reports the byte
// count read, i.e. one past the offending character).
inline std::pair<int, int> line_col(std::string_view text, size_t pos) {
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

struct JsonFields {
  std::string_view config;  // prefix of ConfigError messages, e.g. "cost model"
  std::string_view json;    // prefix of FormatError messages, e.g. "cost JSON"

  void check_time(double v, const std::string& field) const {
    if (!std::isfinite(v) || v < 0)
      throw ConfigError(fmt::format("{}: {} must be finite and >= 0 (got {})", config, field, v));
  }

  void check_bytes(int64_t v, const std::string& field) const {
    if (v < 0) throw ConfigError(fmt::format("{}: {} must be >= 0 (got {})", config, field, v));
  }

  // Parses `text`; a syntax error becomes FormatError(line, column, ...), any
  // other refusal of nlohmann's (a number out of range) FormatError(...).
  nlohmann::json parse(const std::string& text) const {
    try {
      return nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      auto [line, col] = line_col(text, e.byte);
      std::string what = e.what();
      // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
      if (auto k = what.find("] "); k != std::string::npos) what = what.substr(k + 2);
      throw FormatError(line, col, fmt::format("{}: {}", json, what));
    } catch (const nlohmann::json::exception& e) {
      // A number too large for a double (e.g. 1e999) is not a syntax error to
      // nlohmann: out_of_range.406, without a position.
      std::string what = e.what();
      if (auto k = what.find("] "); k != std::string::npos) what = what.substr(k + 2);
      throw FormatError(fmt::format("{}: {}", json, what));
    }
  }

  double get_number(const nlohmann::json& j, const std::string& path) const {
    if (!j.is_number())
      throw FormatError(
          fmt::format("{}: '{}' must be a number (got {})", json, path, j.type_name()));
    return j.get<double>();
  }

  // An integer; a float with an integral value is accepted. `what` names the
  // expected value in the error, e.g. "an integer byte count".
  int64_t get_int(const nlohmann::json& j, const std::string& path, const char* what) const {
    if (j.is_number_integer()) return j.get<int64_t>();
    if (j.is_number_float()) {
      const double d = j.get<double>();
      if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e18)
        return static_cast<int64_t>(d);
      throw FormatError(fmt::format("{}: '{}' must be {} (got {})", json, path, what, d));
    }
    throw FormatError(fmt::format("{}: '{}' must be {} (got {})", json, path, what, j.type_name()));
  }

  void require_object(const nlohmann::json& j, const std::string& path) const {
    if (!j.is_object())
      throw FormatError(
          fmt::format("{}: '{}' must be an object (got {})", json, path, j.type_name()));
  }

  // Applies the keys of the "link" object `j` onto `link`.
  void apply_link(const nlohmann::json& j, LinkCost& link) const {
    require_object(j, "link");
    for (const auto& [key, val] : j.items()) {
      if (key == "latency")
        link.latency = get_number(val, "link.latency");
      else if (key == "bandwidth")
        link.bandwidth = get_number(val, "link.bandwidth");
      else
        throw FormatError(
            fmt::format("{}: unknown key 'link.{}' (link keys: latency, bandwidth)", json, key));
    }
  }
};

}  // namespace baton::detail
