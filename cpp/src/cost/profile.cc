// ModelProfile: JSON reading/writing and validation (cluster.h).
#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "../util/json_fields.h"
#include "baton/cluster.h"
#include "baton/error.h"

namespace baton {

namespace {

using nlohmann::json;

constexpr detail::JsonFields kFields{"model profile", "model profile JSON"};

std::string get_string(const json& j, const std::string& path) {
  if (!j.is_string())
    throw FormatError(
        fmt::format("model profile JSON: '{}' must be a string (got {})", path, j.type_name()));
  return j.get<std::string>();
}

bool get_bool(const json& j, const std::string& path) {
  if (!j.is_boolean())
    throw FormatError(
        fmt::format("model profile JSON: '{}' must be true or false (got {})", path, j.type_name()));
  return j.get<bool>();
}

MatmulShape parse_matmul(const json& j, const std::string& path) {
  kFields.require_object(j, path);
  MatmulShape m;
  for (const auto& item : j.items()) {
    const std::string& key = item.key();
    const json& val = item.value();
    const std::string p = path + "." + key;
    if (key == "m") m.m = kFields.get_number(val, p);
    else if (key == "n") m.n = kFields.get_int(val, p, "an integer");
    else if (key == "k") m.k = kFields.get_int(val, p, "an integer");
    else if (key == "count") m.count = static_cast<int>(kFields.get_int(val, p, "an integer"));
    else if (key == "linear") m.linear = get_bool(val, p);
    else if (key == "tp_dim") m.tp_dim = static_cast<int>(kFields.get_int(val, p, "an integer"));
    else if (key == "expert") m.expert = get_bool(val, p);
    else if (key == "input") m.input = static_cast<int>(kFields.get_int(val, p, "an integer"));
    else
      throw FormatError(fmt::format(
          "model profile JSON: unknown key '{}' (matmul keys: m, n, k, count, linear, tp_dim, "
          "expert, input)",
          p));
  }
  return m;
}

ProfileSegment parse_segment(const json& j, const std::string& path) {
  kFields.require_object(j, path);
  ProfileSegment s;
  for (const auto& item : j.items()) {
    const std::string& key = item.key();
    const json& val = item.value();  // (clang 14 cannot capture a structured binding)
    const std::string p = path + "." + key;
    auto num = [&] { return kFields.get_number(val, p); };
    auto bytes = [&] { return kFields.get_int(val, p, "an integer"); };
    if (key == "name") s.name = get_string(val, p);
    else if (key == "repeat") s.repeat = static_cast<int>(bytes());
    else if (key == "fwd_flops") s.fwd_flops = num();
    else if (key == "bwd_flops") s.bwd_flops = num();
    else if (key == "wgrad_flops") s.wgrad_flops = num();
    else if (key == "hbm_bytes") s.hbm_bytes = num();
    else if (key == "params") s.params = bytes();
    else if (key == "expert_params") s.expert_params = bytes();
    else if (key == "act_bytes") s.act_bytes = bytes();
    else if (key == "stash_keep") s.stash_keep = bytes();
    else if (key == "stash_min") s.stash_min = bytes();
    else if (key == "min_recompute_flops") s.min_recompute_flops = num();
    else if (key == "stash_full") s.stash_full = bytes();
    else if (key == "temp_bytes") s.temp_bytes = bytes();
    else if (key == "tp_collectives") s.tp_collectives = static_cast<int>(bytes());
    else if (key == "tp_bytes") s.tp_bytes = bytes();
    else if (key == "a2a_collectives") s.a2a_collectives = static_cast<int>(bytes());
    else if (key == "a2a_bytes") s.a2a_bytes = bytes();
    else if (key == "a2a_top_k") s.a2a_top_k = static_cast<int>(bytes());
    else if (key == "attn_flops") s.attn_flops = num();
    else if (key == "attn_causal") s.attn_causal = get_bool(val, p);
    else if (key == "attn_scores") s.attn_scores = num();
    else if (key == "mem_bytes") s.mem_bytes = num();
    else if (key == "mem_bytes_replicated") s.mem_bytes_replicated = num();
    else if (key == "kernels") s.kernels = static_cast<int>(bytes());
    else if (key == "matmuls") {
      if (!val.is_array())
        throw FormatError(fmt::format("model profile JSON: '{}' must be an array", p));
      for (size_t k = 0; k < val.size(); ++k)
        s.matmuls.push_back(parse_matmul(val[k], fmt::format("{}[{}]", p, k)));
    } else
      throw FormatError(fmt::format(
          "model profile JSON: unknown key '{}' (segment keys: name, repeat, fwd_flops, "
          "bwd_flops, wgrad_flops, hbm_bytes, params, expert_params, act_bytes, stash_keep, "
          "stash_min, min_recompute_flops, stash_full, temp_bytes, tp_collectives, tp_bytes, "
          "a2a_collectives, a2a_bytes, a2a_top_k, matmuls, attn_flops, attn_scores, "
          "attn_causal, mem_bytes, mem_bytes_replicated, kernels)",
          p));
  }
  return s;
}

json segment_json(const ProfileSegment& s) {
  json mm = json::array();
  for (const MatmulShape& m : s.matmuls)
    mm.push_back({{"m", m.m}, {"n", m.n}, {"k", m.k}, {"count", m.count}, {"linear", m.linear},
                  {"tp_dim", m.tp_dim}, {"expert", m.expert}, {"input", m.input}});
  return json{{"name", s.name},
              {"matmuls", mm},
              {"attn_flops", s.attn_flops},
              {"attn_scores", s.attn_scores},
              {"attn_causal", s.attn_causal},
              {"mem_bytes", s.mem_bytes},
              {"mem_bytes_replicated", s.mem_bytes_replicated},
              {"kernels", s.kernels},
              {"repeat", s.repeat},
              {"fwd_flops", s.fwd_flops},
              {"bwd_flops", s.bwd_flops},
              {"wgrad_flops", s.wgrad_flops},
              {"hbm_bytes", s.hbm_bytes},
              {"params", s.params},
              {"expert_params", s.expert_params},
              {"act_bytes", s.act_bytes},
              {"stash_keep", s.stash_keep},
              {"stash_min", s.stash_min},
              {"min_recompute_flops", s.min_recompute_flops},
              {"stash_full", s.stash_full},
              {"temp_bytes", s.temp_bytes},
              {"tp_collectives", s.tp_collectives},
              {"tp_bytes", s.tp_bytes},
              {"a2a_collectives", s.a2a_collectives},
              {"a2a_bytes", s.a2a_bytes},
              {"a2a_top_k", s.a2a_top_k}};
}

}  // namespace

int64_t ModelProfile::total_params() const {
  int64_t n = 0;
  for (const ProfileSegment& s : segments) n += s.params * s.repeat;
  return n;
}

int ModelProfile::num_layers() const {
  int n = 0;
  for (const ProfileSegment& s : segments) n += s.repeat;
  return n;
}

void ModelProfile::validate() const {
  if (seq < 1) throw ConfigError(fmt::format("model profile: seq must be >= 1 (got {})", seq));
  kFields.check_time(model_flops_per_sample, "model_flops_per_sample");
  if (max_tp < 1)
    throw ConfigError(fmt::format("model profile: max_tp must be >= 1 (got {})", max_tp));
  if (num_experts < 0)
    throw ConfigError(
        fmt::format("model profile: num_experts must be >= 0 (got {})", num_experts));
  if (segments.empty()) throw ConfigError("model profile: 'segments' is empty");
  for (size_t k = 0; k < segments.size(); ++k) {
    const ProfileSegment& s = segments[k];
    const std::string w = fmt::format("segments[{}]", k);
    if (s.repeat < 1)
      throw ConfigError(fmt::format("model profile: {}.repeat must be >= 1 (got {})", w, s.repeat));
    kFields.check_time(s.fwd_flops, w + ".fwd_flops");
    kFields.check_time(s.bwd_flops, w + ".bwd_flops");
    kFields.check_time(s.wgrad_flops, w + ".wgrad_flops");
    if (s.wgrad_flops > s.bwd_flops)
      throw ConfigError(fmt::format("model profile: {}.wgrad_flops ({}) exceeds bwd_flops ({})",
                                    w, s.wgrad_flops, s.bwd_flops));
    kFields.check_time(s.hbm_bytes, w + ".hbm_bytes");
    kFields.check_bytes(s.params, w + ".params");
    kFields.check_bytes(s.expert_params, w + ".expert_params");
    if (s.expert_params > s.params)
      throw ConfigError(
          fmt::format("model profile: {}.expert_params exceeds {}.params", w, w));
    kFields.check_bytes(s.act_bytes, w + ".act_bytes");
    kFields.check_bytes(s.stash_keep, w + ".stash_keep");
    kFields.check_bytes(s.stash_min, w + ".stash_min");
    kFields.check_time(s.min_recompute_flops, w + ".min_recompute_flops");
    kFields.check_bytes(s.stash_full, w + ".stash_full");
    kFields.check_bytes(s.temp_bytes, w + ".temp_bytes");
    kFields.check_bytes(s.tp_collectives, w + ".tp_collectives");
    kFields.check_bytes(s.tp_bytes, w + ".tp_bytes");
    kFields.check_bytes(s.a2a_collectives, w + ".a2a_collectives");
    kFields.check_bytes(s.a2a_bytes, w + ".a2a_bytes");
    kFields.check_bytes(s.a2a_top_k, w + ".a2a_top_k");
    kFields.check_time(s.attn_flops, w + ".attn_flops");
    kFields.check_time(s.attn_scores, w + ".attn_scores");
    kFields.check_time(s.mem_bytes, w + ".mem_bytes");
    kFields.check_time(s.mem_bytes_replicated, w + ".mem_bytes_replicated");
    if (s.mem_bytes_replicated > s.mem_bytes)
      throw ConfigError(fmt::format("model profile: {}.mem_bytes_replicated ({}) exceeds its "
                                    "mem_bytes ({})",
                                    w, s.mem_bytes_replicated, s.mem_bytes));
    kFields.check_bytes(s.kernels, w + ".kernels");
    for (size_t q = 0; q < s.matmuls.size(); ++q) {
      const MatmulShape& m = s.matmuls[q];
      const std::string mw = fmt::format("{}.matmuls[{}]", w, q);
      if (!std::isfinite(m.m) || m.m <= 0 || m.n < 1 || m.k < 1 || m.count < 1)
        throw ConfigError(fmt::format(
            "model profile: {} needs m > 0 and n, k, count >= 1 (got m {} n {} k {} count {})",
            mw, m.m, m.n, m.k, m.count));
      if (m.tp_dim < 0 || m.tp_dim > 2)
        throw ConfigError(
            fmt::format("model profile: {}.tp_dim must be 0, 1 or 2 (got {})", mw, m.tp_dim));
      if (m.input >= 0) {
        const auto& first = m.input < static_cast<int>(q) ? s.matmuls[m.input] : m;
        if (m.input >= static_cast<int>(q) || !m.linear || !first.linear || first.input != -1 ||
            first.m != m.m || first.k != m.k || first.count != m.count ||
            (first.tp_dim == 2) != (m.tp_dim == 2) || first.expert != m.expert)
          throw ConfigError(fmt::format(
              "model profile: {}.input must name an earlier linear matmul that reads the same "
              "activation (same m, k, count and expert, both or neither row-parallel, its own "
              "input -1; got {})",
              mw, m.input));
      } else if (m.input != -1) {
        throw ConfigError(
            fmt::format("model profile: {}.input must be -1 or an earlier matmul (got {})", mw,
                        m.input));
      }
    }
  }
}

ModelProfile ModelProfile::from_json(const std::string& text) {
  const json root = kFields.parse(text);
  kFields.require_object(root, "<root>");
  ModelProfile m;
  bool have_segments = false;
  for (const auto& [key, val] : root.items()) {
    if (key == "name") {
      m.name = get_string(val, key);
    } else if (key == "seq") {
      m.seq = kFields.get_int(val, key, "an integer");
    } else if (key == "model_flops_per_sample") {
      m.model_flops_per_sample = kFields.get_number(val, key);
    } else if (key == "max_tp") {
      m.max_tp = static_cast<int>(kFields.get_int(val, key, "an integer"));
    } else if (key == "num_experts") {
      m.num_experts = static_cast<int>(kFields.get_int(val, key, "an integer"));
    } else if (key == "segments") {
      if (!val.is_array())
        throw FormatError(fmt::format(
            "model profile JSON: 'segments' must be an array (got {})", val.type_name()));
      have_segments = true;
      for (size_t k = 0; k < val.size(); ++k)
        m.segments.push_back(parse_segment(val[k], fmt::format("segments[{}]", k)));
    } else {
      throw FormatError(fmt::format(
          "model profile JSON: unknown key '{}' (top-level keys: name, seq, "
          "model_flops_per_sample, max_tp, num_experts, segments)",
          key));
    }
  }
  if (!have_segments) throw FormatError("model profile JSON: 'segments' is required");
  m.validate();
  return m;
}

std::string ModelProfile::to_json() const {
  json segs = json::array();
  for (const ProfileSegment& s : segments) segs.push_back(segment_json(s));
  json j{{"name", name},         {"seq", seq},
         {"model_flops_per_sample", model_flops_per_sample},
         {"max_tp", max_tp},     {"num_experts", num_experts},
         {"segments", segs}};
  return j.dump(1);
}

}  // namespace baton
