// The schedule text format (grammar in text_format.h and docs/SCHEDULES.md).
#include "baton/text_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <optional>
#include <vector>

#include "baton/error.h"

namespace baton {

std::string save_schedule(const Schedule& s) {
  std::string out = "baton-schedule 1\n";
  if (!s.name.empty()) out += fmt::format("name {}\n", s.name);
  out += fmt::format("ranks {}\nstages {}\nmicrobatches {}\nplacement", s.num_ranks, s.num_stages,
                     s.num_microbatches);
  for (int32_t r : s.stage_rank) out += fmt::format(" {}", r);
  out += '\n';
  for (size_t r = 0; r < s.rank_actions.size(); ++r) {
    out += fmt::format("rank {}:", r);
    for (const Action& a : s.rank_actions[r]) {
      out += ' ';
      out += to_string(a);
    }
    out += '\n';
  }
  return out;
}

namespace {

struct Token {
  std::string_view text;
  int col = 0;  // 1-based
};

struct Line {
  int number = 0;
  std::vector<Token> tokens;
};

std::vector<Token> tokenize(std::string_view line) {
  std::vector<Token> out;
  size_t i = 0;
  const size_t n = line.size();
  while (i < n) {
    while (i < n && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i >= n || line[i] == '#') break;
    const size_t start = i;
    while (i < n && line[i] != ' ' && line[i] != '\t' && line[i] != '#') ++i;
    out.push_back(Token{line.substr(start, i - start), static_cast<int>(start) + 1});
  }
  return out;
}

// Parses a non-negative decimal integer (at most 9 digits) filling the whole
// view; returns nullopt otherwise.
std::optional<int32_t> parse_uint(std::string_view t) {
  if (t.empty() || t.size() > 9) return std::nullopt;
  int32_t v = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || p != t.data() + t.size() || v < 0) return std::nullopt;
  return v;
}

// Signed integer for header values (so that "ranks -1" reaches validate()).
std::optional<int32_t> parse_int(std::string_view t) {
  if (!t.empty() && t[0] == '-') {
    auto v = parse_uint(t.substr(1));
    if (!v) return std::nullopt;
    return -*v;
  }
  return parse_uint(t);
}

std::optional<Task> parse_task(std::string_view t) {
  if (t.size() < 4) return std::nullopt;
  Task task;
  switch (t[0]) {
    case 'F':
      task.kind = TaskKind::F;
      break;
    case 'B':
      task.kind = TaskKind::B;
      break;
    case 'I':
      task.kind = TaskKind::I;
      break;
    case 'W':
      task.kind = TaskKind::W;
      break;
    default:
      return std::nullopt;
  }
  const size_t dot = t.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  auto stage = parse_uint(t.substr(1, dot - 1));
  auto mb = parse_uint(t.substr(dot + 1));
  if (!stage || !mb) return std::nullopt;
  task.stage = *stage;
  task.microbatch = *mb;
  return task;
}

std::optional<Action> parse_action(std::string_view t) {
  const size_t plus = t.find('+');
  if (plus == std::string_view::npos) {
    auto a = parse_task(t);
    if (!a) return std::nullopt;
    return Action{*a};
  }
  auto a = parse_task(t.substr(0, plus));
  auto b = parse_task(t.substr(plus + 1));
  if (!a || !b) return std::nullopt;
  return Action{*a, *b};
}

constexpr int32_t kMaxCount = 1 << 20;  // ranks, stages, microbatches

[[noreturn]] void fail(int line, int col, const std::string& what) {
  throw FormatError(line, col, what);
}

struct Where {
  int line = 0;
  int col = 0;
};

// Source positions of everything load_schedule read, to place content errors.
struct SourceMap {
  Where ranks, stages, microbatches, placement;
  std::vector<int> placement_cols;
  std::vector<int> row_line;               // per rank
  std::vector<std::vector<int>> row_cols;  // per rank, per action
};

// Mirrors the order of the checks in Schedule::validate() and returns where
// the first failing one points in the source.
Where locate(const Schedule& s, const SourceMap& src) {
  if (s.num_ranks <= 0) return src.ranks;
  if (s.num_stages <= 0) return src.stages;
  if (s.num_microbatches <= 0) return src.microbatches;
  if (static_cast<int32_t>(s.stage_rank.size()) != s.num_stages) return src.placement;
  for (int32_t st = 0; st < s.num_stages; ++st)
    if (s.stage_rank[st] < 0 || s.stage_rank[st] >= s.num_ranks)
      return Where{src.placement.line, src.placement_cols[st]};
  for (int32_t r = 0; r < s.num_ranks; ++r)
    if (std::find(s.stage_rank.begin(), s.stage_rank.end(), r) == s.stage_rank.end())
      return src.placement;
  const size_t n = static_cast<size_t>(s.num_stages) * s.num_microbatches;
  std::vector<std::array<int, 4>> count(n, {0, 0, 0, 0});
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    const auto& row = s.rank_actions[r];
    for (size_t k = 0; k < row.size(); ++k) {
      const Where here{src.row_line[r], src.row_cols[r][k]};
      for (const Task* t : {&row[k].first, row[k].is_fused() ? &row[k].second : nullptr}) {
        if (!t) continue;
        if (t->stage < 0 || t->stage >= s.num_stages || t->microbatch < 0 ||
            t->microbatch >= s.num_microbatches || s.stage_rank[t->stage] != r)
          return here;
        if (++count[static_cast<size_t>(t->stage) * s.num_microbatches + t->microbatch]
                   [static_cast<int>(t->kind)] > 1)
          return here;
      }
    }
  }
  // A task is missing: point at the row of the rank that should hold it.
  for (int32_t st = 0; st < s.num_stages; ++st)
    for (int32_t mb = 0; mb < s.num_microbatches; ++mb) {
      const auto& c = count[static_cast<size_t>(st) * s.num_microbatches + mb];
      const bool ok =
          c[0] == 1 && ((c[1] == 1 && !c[2] && !c[3]) || (c[1] == 0 && c[2] == 1 && c[3] == 1));
      if (!ok) return Where{src.row_line[s.stage_rank[st]], 0};
    }
  return Where{};
}

}  // namespace

Schedule load_schedule(std::string_view text) {
  std::vector<Line> lines;
  {
    int number = 0;
    size_t pos = 0;
    while (pos <= text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string_view::npos) end = text.size();
      std::string_view raw = text.substr(pos, end - pos);
      if (!raw.empty() && raw.back() == '\r') raw.remove_suffix(1);
      ++number;
      auto toks = tokenize(raw);
      if (!toks.empty()) lines.push_back(Line{number, std::move(toks)});
      if (end == text.size()) break;
      pos = end + 1;
    }
    if (lines.empty()) fail(1, 1, "empty schedule: expected 'baton-schedule 1'");
  }
  const int eof_line = [&] {
    int n = 1;
    for (char c : text) n += c == '\n';
    return n;
  }();

  // Header line.
  {
    const Line& l = lines.front();
    if (l.tokens[0].text != "baton-schedule")
      fail(l.number, l.tokens[0].col,
           fmt::format("missing header: expected 'baton-schedule 1', got '{}'", l.tokens[0].text));
    if (l.tokens.size() != 2) fail(l.number, l.tokens[0].col, "expected 'baton-schedule 1'");
    if (l.tokens[1].text != "1")
      fail(l.number, l.tokens[1].col,
           fmt::format("unsupported format version '{}' (this reader knows version 1)",
                       l.tokens[1].text));
  }

  Schedule s;
  SourceMap src;
  std::optional<int32_t> ranks, stages, mbs;
  bool have_name = false, have_placement = false;
  std::vector<std::vector<Action>> rows;
  std::vector<int> row_line;

  auto one_int = [&](const Line& l, std::optional<int32_t>& dst, Where& where) {
    const Token& key = l.tokens[0];
    if (dst)
      fail(l.number, key.col,
           fmt::format("duplicate '{}' (first given on line {})", key.text, where.line));
    if (l.tokens.size() != 2)
      fail(l.number, key.col, fmt::format("'{}' takes exactly one integer", key.text));
    auto v = parse_int(l.tokens[1].text);
    if (!v)
      fail(l.number, l.tokens[1].col,
           fmt::format("expected an integer, got '{}'", l.tokens[1].text));
    if (*v > kMaxCount)
      fail(l.number, l.tokens[1].col,
           fmt::format("'{}' = {} is larger than this reader accepts ({})", key.text, *v,
                       kMaxCount));
    dst = *v;
    where = Where{l.number, l.tokens[1].col};
  };

  int name_line = 0, placement_line = 0;
  for (size_t li = 1; li < lines.size(); ++li) {
    const Line& l = lines[li];
    const Token& key = l.tokens[0];
    if (key.text == "name") {
      if (have_name)
        fail(l.number, key.col,
             fmt::format("duplicate 'name' (first given on line {})", name_line));
      if (l.tokens.size() != 2) fail(l.number, key.col, "'name' takes exactly one word");
      s.name = std::string(l.tokens[1].text);
      have_name = true;
      name_line = l.number;
    } else if (key.text == "ranks") {
      one_int(l, ranks, src.ranks);
    } else if (key.text == "stages") {
      one_int(l, stages, src.stages);
    } else if (key.text == "microbatches") {
      one_int(l, mbs, src.microbatches);
    } else if (key.text == "placement") {
      if (have_placement)
        fail(l.number, key.col,
             fmt::format("duplicate 'placement' (first given on line {})", placement_line));
      for (size_t i = 1; i < l.tokens.size(); ++i) {
        auto v = parse_int(l.tokens[i].text);
        if (!v)
          fail(l.number, l.tokens[i].col,
               fmt::format("expected a rank number, got '{}'", l.tokens[i].text));
        s.stage_rank.push_back(*v);
        src.placement_cols.push_back(l.tokens[i].col);
      }
      have_placement = true;
      placement_line = l.number;
      src.placement = Where{l.number, key.col};
    } else if (key.text == "rank") {
      const char* missing = !ranks            ? "ranks"
                            : !stages         ? "stages"
                            : !mbs            ? "microbatches"
                            : !have_placement ? "placement"
                                              : nullptr;
      if (missing)
        fail(l.number, key.col,
             fmt::format("'rank' row before the header is complete (missing '{}')", missing));
      if (l.tokens.size() < 2) fail(l.number, key.col, "expected 'rank <index>:'");
      // Accept "rank 3: ..." and "rank 3 : ...".
      std::string_view idx = l.tokens[1].text;
      size_t first_task = 2;
      if (!idx.empty() && idx.back() == ':') {
        idx.remove_suffix(1);
      } else if (l.tokens.size() >= 3 && l.tokens[2].text == ":") {
        first_task = 3;
      } else {
        fail(l.number, l.tokens[1].col + static_cast<int>(idx.size()),
             "expected ':' after the rank index");
      }
      auto r = parse_uint(idx);
      if (!r) fail(l.number, l.tokens[1].col, fmt::format("expected a rank index, got '{}'", idx));
      if (*r >= *ranks)
        fail(l.number, l.tokens[1].col, fmt::format("rank {} out of range 0..{}", *r, *ranks - 1));
      if (rows.empty()) {
        rows.resize(std::max(*ranks, 0));
        row_line.assign(rows.size(), 0);
        src.row_cols.resize(rows.size());
      }
      if (row_line[*r])
        fail(l.number, l.tokens[1].col,
             fmt::format("duplicate row for rank {} (first given on line {})", *r, row_line[*r]));
      row_line[*r] = l.number;
      for (size_t i = first_task; i < l.tokens.size(); ++i) {
        auto a = parse_action(l.tokens[i].text);
        if (!a)
          fail(
              l.number, l.tokens[i].col,
              fmt::format(
                  "bad task token '{}': expected <kind><stage>.<microbatch> with kind F, B, I or W "
                  "(e.g. F0.3), or two joined by '+' (e.g. F0.3+B7.1)",
                  l.tokens[i].text));
        rows[*r].push_back(*a);
        src.row_cols[*r].push_back(l.tokens[i].col);
      }
    } else {
      fail(l.number, key.col,
           fmt::format(
               "unknown key '{}' (expected name, ranks, stages, microbatches, placement or rank)",
               key.text));
    }
  }

  for (auto [have, what] :
       {std::pair{ranks.has_value(), "ranks"}, std::pair{stages.has_value(), "stages"},
        std::pair{mbs.has_value(), "microbatches"}, std::pair{have_placement, "placement"}})
    if (!have) fail(eof_line, 1, fmt::format("missing '{}'", what));
  int found = 0;
  for (int ln : row_line) found += ln != 0;
  if (found != std::max(*ranks, 0)) {
    std::string which;
    for (size_t r = 0; r < row_line.size(); ++r)
      if (!row_line[r]) {
        which = fmt::format(" (first missing: rank {})", r);
        break;
      }
    if (row_line.empty() && *ranks > 0) which = " (first missing: rank 0)";
    fail(eof_line, 1, fmt::format("expected {} 'rank' rows, found {}{}", *ranks, found, which));
  }

  s.num_ranks = *ranks;
  s.num_stages = *stages;
  s.num_microbatches = *mbs;
  s.rank_actions = std::move(rows);
  src.row_line = std::move(row_line);
  try {
    s.validate();
  } catch (const ScheduleError& e) {
    const Where w = locate(s, src);
    if (w.col > 0)
      throw ScheduleError(fmt::format("line {}, column {}: {}", w.line, w.col, e.what()));
    throw ScheduleError(fmt::format("line {}: {}", w.line, e.what()));
  }
  return s;
}

}  // namespace baton
