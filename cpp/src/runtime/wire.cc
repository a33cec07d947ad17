// Decoders of peer bytes (wire.h).
#include "wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>

namespace baton::runtime::wire {

namespace {

// The whitespace-separated tokens of `s`.
std::vector<std::string_view> tokens(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  auto space = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; };
  while (i < s.size()) {
    while (i < s.size() && space(s[i])) ++i;
    const size_t start = i;
    while (i < s.size() && !space(s[i])) ++i;
    if (i > start) out.push_back(s.substr(start, i - start));
  }
  return out;
}

// A whole token as an integer of type T, or false.
template <class T>
bool to_int(std::string_view t, T& v) {
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  return ec == std::errc() && end == t.data() + t.size();
}

}  // namespace

std::string encode_meta(const Layout& layout) {
  std::string s = fmt::format("{}\n", layout.size());
  for (const TensorSpec& t : layout) {
    s += fmt::format("{} {}", static_cast<int>(t.dtype), t.shape.size());
    for (int64_t d : t.shape) s += fmt::format(" {}", d);
    s += "\n";
  }
  return s;
}

void check_meta_len(uint64_t len, int peer) {
  if (len > kMaxMetaBytes)
    throw ExecutionError(
        fmt::format("malformed transfer header from rank {}: it claims {} bytes of meta (at most "
                    "{}; is that process running Baton with the same plan?)",
                    peer, len, kMaxMetaBytes),
        peer);
}

Layout decode_meta(std::string_view meta, int peer) {
  auto bad = [&](const std::string& why) {
    return ExecutionError(fmt::format("malformed transfer header from rank {}: {}", peer, why),
                          peer);
  };
  const auto tok = tokens(meta);
  size_t at = 0;
  auto next = [&](const char* what) {
    if (at >= tok.size()) throw bad(fmt::format("it ends before {}", what));
    return tok[at++];
  };
  uint64_t n = 0;
  if (!to_int(next("the tensor count"), n)) throw bad("the tensor count is not a number");
  // Each tensor takes at least two tokens (dtype code, rank).
  if (n > (tok.size() - at) / 2)
    throw bad(fmt::format("it announces {} tensors in {} bytes", n, meta.size()));
  Layout out;
  out.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    int code = -1;
    uint64_t nd = 0;
    if (!to_int(next("a dtype code"), code)) throw bad(fmt::format("tensor {}: bad dtype code", i));
    if (code < 0 || code > static_cast<int>(DType::Bool))
      throw bad(fmt::format("tensor {}: unknown dtype code {}", i, code));
    if (!to_int(next("a tensor rank"), nd)) throw bad(fmt::format("tensor {}: bad rank", i));
    if (nd > tok.size() - at)
      throw bad(
          fmt::format("tensor {}: rank {} but only {} values follow", i, nd, tok.size() - at));
    TensorSpec spec;
    spec.dtype = static_cast<DType>(code);
    spec.shape.reserve(nd);
    uint64_t bytes = dtype_size(spec.dtype);
    for (uint64_t k = 0; k < nd; ++k) {
      int64_t d = -1;
      if (!to_int(next("a dimension"), d) || d < 0)
        throw bad(fmt::format("tensor {}: dimension {} is not a size", i, k));
      if (d != 0 && bytes > kMaxTensorBytes / static_cast<uint64_t>(d))
        bytes = kMaxTensorBytes + 1;
      else
        bytes *= static_cast<uint64_t>(d);
      spec.shape.push_back(d);
    }
    // A zero dimension makes the tensor empty whatever the others claim.
    if (std::find(spec.shape.begin(), spec.shape.end(), 0) == spec.shape.end() &&
        bytes > kMaxTensorBytes)
      throw bad(fmt::format("tensor {} claims more than {} bytes", i, kMaxTensorBytes));
    out.push_back(std::move(spec));
  }
  if (at != tok.size()) throw bad(fmt::format("{} unexpected values at its end", tok.size() - at));
  return out;
}

std::string encode_addresses(const std::vector<std::vector<char>>& per_peer) {
  std::string out;
  for (const auto& bytes : per_peer) {
    const auto n = static_cast<uint32_t>(bytes.size());
    const char len[4] = {static_cast<char>(n & 0xff), static_cast<char>((n >> 8) & 0xff),
                         static_cast<char>((n >> 16) & 0xff), static_cast<char>(n >> 24)};
    out.append(len, 4);
    out.append(bytes.begin(), bytes.end());
  }
  return out;
}

std::vector<char> address_for(std::string_view blob, int publisher, int reader, int world) {
  size_t at = 0;
  for (int q = 0; q < world && publisher != reader; ++q) {
    if (q == publisher) continue;
    if (blob.size() - at < 4) break;
    const auto* u = reinterpret_cast<const unsigned char*>(blob.data() + at);
    const size_t n = u[0] | (u[1] << 8) | (u[2] << 16) | (size_t{u[3]} << 24);
    at += 4;
    if (blob.size() - at < n) break;
    if (q == reader) return std::vector<char>(blob.data() + at, blob.data() + at + n);
    at += n;
  }
  throw ExecutionError(
      fmt::format("rank {}: gloo start-up: the address published by rank {} is malformed "
                  "({} bytes; do both ranks use the same world size and store prefix?)",
                  reader, publisher, blob.size()),
      publisher);
}

Control decode_control(const ControlMsg& m, int peer, int world) {
  Control c;
  c.kind = m.kind;
  c.origin = m.origin >= 0 && m.origin < world ? m.origin : peer;
  c.text.assign(m.text, strnlen(m.text, sizeof(m.text) - 1));
  return c;
}

std::string encode_abort_note(int origin, std::string_view reason) {
  return fmt::format("{}|{}", origin, reason);
}

AbortNote decode_abort_note(std::string_view note, int world) {
  AbortNote a;
  const auto bar = note.find('|');
  if (bar == std::string_view::npos) {
    a.reason = std::string(note);
    return a;
  }
  int origin = -1;
  if (to_int(note.substr(0, bar), origin) && origin >= 0 && origin < world) a.origin = origin;
  a.reason = std::string(note.substr(bar + 1));
  return a;
}

}  // namespace baton::runtime::wire
