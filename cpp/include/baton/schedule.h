// Schedule IR: a pipeline schedule is plain data. For each rank, an ordered
// list of actions on (stage, microbatch); the stage->rank placement is part of
// the schedule.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace baton {

// F: forward. B: full backward. I: backward for the input gradient only.
// W: backward for the weight gradient only (B == I followed by W).
enum class TaskKind : uint8_t { F = 0, B = 1, I = 2, W = 3 };

char task_kind_char(TaskKind k);  // 'F', 'B', 'I', 'W'

struct Task {
  TaskKind kind = TaskKind::F;
  int32_t stage = -1;
  int32_t microbatch = -1;
  bool operator==(const Task&) const = default;
};

// One entry of a rank's action list. Usually a single task; a fused action
// runs two tasks as one unit (DualPipe overlaps F of one microbatch with B of
// another so that the communication of one hides behind the compute of the
// other). `second.stage < 0` means "not fused".
struct Action {
  Task first;
  Task second{TaskKind::F, -1, -1};
  bool is_fused() const { return second.stage >= 0; }
  bool operator==(const Action&) const = default;
};

// Stage -> rank placements.
//   contiguous:  p stages, stage s on rank s.
//   interleaved: p*v stages, stage s on rank s mod p ("looped").
//   v:           2p stages, rank r holds stages r and 2p-1-r.
std::vector<int32_t> contiguous_placement(int ranks);
std::vector<int32_t> interleaved_placement(int ranks, int virtual_stages);
std::vector<int32_t> v_placement(int ranks);

struct Schedule {
  std::string name;  // generator name ("1f1b", ...) or "custom"
  int32_t num_ranks = 0;
  int32_t num_stages = 0;
  int32_t num_microbatches = 0;
  std::vector<int32_t> stage_rank;                 // size num_stages
  std::vector<std::vector<Action>> rank_actions;   // size num_ranks

  // True when any action uses I/W instead of B.
  bool split_backward() const;
  // Stages held by a rank, ascending.
  std::vector<int32_t> stages_of_rank(int rank) const;
  // Structural checks (sizes, ranges, placement, every task on the rank owning
  // its stage, exactly one F and one B-or-(I and W) per (stage, microbatch)).
  // Throws ScheduleError naming the rank, action index, stage and microbatch.
  void validate() const;
  bool operator==(const Schedule&) const = default;
};

// Human-readable one-line form of a task / action, e.g. "F3.0", "F0.3+B7.1".
std::string to_string(const Task& t);
std::string to_string(const Action& a);

}  // namespace baton
