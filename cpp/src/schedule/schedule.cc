#include "baton/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "baton/error.h"

namespace baton {

FormatError::FormatError(int l, int c, const std::string& what)
    : Error(fmt::format("line {}, column {}: {}", l, c, what)), line(l), column(c) {}

char task_kind_char(TaskKind k) {
  switch (k) {
    case TaskKind::F: return 'F';
    case TaskKind::B: return 'B';
    case TaskKind::I: return 'I';
    case TaskKind::W: return 'W';
  }
  return '?';
}

std::string to_string(const Task& t) {
  return fmt::format("{}{}.{}", task_kind_char(t.kind), t.stage, t.microbatch);
}

std::string to_string(const Action& a) {
  if (!a.is_fused()) return to_string(a.first);
  return to_string(a.first) + "+" + to_string(a.second);
}

std::vector<int32_t> contiguous_placement(int ranks) {
  std::vector<int32_t> out(std::max(ranks, 0));
  for (int s = 0; s < ranks; ++s) out[s] = s;
  return out;
}

std::vector<int32_t> interleaved_placement(int ranks, int virtual_stages) {
  std::vector<int32_t> out;
  if (ranks <= 0 || virtual_stages <= 0) return out;
  out.resize(static_cast<size_t>(ranks) * virtual_stages);
  for (size_t s = 0; s < out.size(); ++s) out[s] = static_cast<int32_t>(s % ranks);
  return out;
}

std::vector<int32_t> v_placement(int ranks) {
  std::vector<int32_t> out;
  if (ranks <= 0) return out;
  out.resize(2 * static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    out[r] = r;
    out[2 * ranks - 1 - r] = r;
  }
  return out;
}

bool Schedule::split_backward() const {
  for (const auto& row : rank_actions)
    for (const auto& a : row) {
      auto is_iw = [](const Task& t) { return t.kind == TaskKind::I || t.kind == TaskKind::W; };
      if (is_iw(a.first) || (a.is_fused() && is_iw(a.second))) return true;
    }
  return false;
}

std::vector<int32_t> Schedule::stages_of_rank(int rank) const {
  std::vector<int32_t> out;
  for (int32_t s = 0; s < static_cast<int32_t>(stage_rank.size()); ++s)
    if (stage_rank[s] == rank) out.push_back(s);
  return out;
}

void Schedule::validate() const {
  if (num_ranks <= 0) throw ScheduleError(fmt::format("schedule '{}': ranks must be >= 1 (got {})", name, num_ranks));
  if (num_stages <= 0) throw ScheduleError(fmt::format("schedule '{}': stages must be >= 1 (got {})", name, num_stages));
  if (num_microbatches <= 0)
    throw ScheduleError(fmt::format("schedule '{}': microbatches must be >= 1 (got {})", name, num_microbatches));
  if (static_cast<int32_t>(stage_rank.size()) != num_stages)
    throw ScheduleError(fmt::format("schedule '{}': placement lists {} stages but the schedule has {}", name,
                                    stage_rank.size(), num_stages));
  for (int32_t s = 0; s < num_stages; ++s)
    if (stage_rank[s] < 0 || stage_rank[s] >= num_ranks)
      throw ScheduleError(fmt::format("schedule '{}': stage {} is placed on rank {}, but ranks are 0..{}", name, s,
                                      stage_rank[s], num_ranks - 1));
  for (int32_t r = 0; r < num_ranks; ++r)
    if (std::find(stage_rank.begin(), stage_rank.end(), r) == stage_rank.end())
      throw ScheduleError(fmt::format("schedule '{}': rank {} holds no stage", name, r));
  if (static_cast<int32_t>(rank_actions.size()) != num_ranks)
    throw ScheduleError(fmt::format("schedule '{}': has action lists for {} ranks but ranks = {}", name,
                                    rank_actions.size(), num_ranks));

  // count[(stage, mb)][kind]
  const size_t n = static_cast<size_t>(num_stages) * num_microbatches;
  std::vector<std::array<int, 4>> count(n, {0, 0, 0, 0});
  for (int32_t r = 0; r < num_ranks; ++r) {
    const auto& row = rank_actions[r];
    for (size_t k = 0; k < row.size(); ++k) {
      const Action& a = row[k];
      for (const Task* t : {&a.first, a.is_fused() ? &a.second : nullptr}) {
        if (!t) continue;
        if (t->stage < 0 || t->stage >= num_stages)
          throw ScheduleError(fmt::format("schedule '{}': rank {} action {} ({}): stage {} out of range 0..{}", name,
                                          r, k, to_string(a), t->stage, num_stages - 1));
        if (t->microbatch < 0 || t->microbatch >= num_microbatches)
          throw ScheduleError(fmt::format("schedule '{}': rank {} action {} ({}): microbatch {} out of range 0..{}",
                                          name, r, k, to_string(a), t->microbatch, num_microbatches - 1));
        if (stage_rank[t->stage] != r)
          throw ScheduleError(fmt::format(
              "schedule '{}': rank {} action {} ({}) runs stage {}, which is placed on rank {}", name, r, k,
              to_string(a), t->stage, stage_rank[t->stage]));
        int& c = count[static_cast<size_t>(t->stage) * num_microbatches + t->microbatch][static_cast<int>(t->kind)];
        if (++c > 1)
          throw ScheduleError(fmt::format("schedule '{}': rank {} action {}: {} appears more than once", name, r, k,
                                          to_string(*t)));
      }
    }
  }
  for (int32_t s = 0; s < num_stages; ++s)
    for (int32_t m = 0; m < num_microbatches; ++m) {
      const auto& c = count[static_cast<size_t>(s) * num_microbatches + m];
      const int f = c[0], b = c[1], i = c[2], w = c[3];
      if (f != 1)
        throw ScheduleError(fmt::format("schedule '{}': stage {} microbatch {} has no F (rank {})", name, s, m,
                                        stage_rank[s]));
      if (b == 1 && (i || w))
        throw ScheduleError(fmt::format("schedule '{}': stage {} microbatch {} has both B and I/W (rank {})", name,
                                        s, m, stage_rank[s]));
      if (b == 0 && !(i == 1 && w == 1))
        throw ScheduleError(fmt::format(
            "schedule '{}': stage {} microbatch {} needs one B or one I and one W (has I={}, W={}; rank {})", name, s,
            m, i, w, stage_rank[s]));
    }
}

}  // namespace baton
