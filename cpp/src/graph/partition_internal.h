// Internal (not installed): the state the passes of partition() share, and
// the passes themselves (see graph.h for the algorithm, in six steps).
//   - partition_stages.cc: steps 1-4 and 6, which stage every op runs on;
//   - partition_tasks.cc: step 5, the tasks of each stage and what they send;
//   - partition.cc: the driver and Partition's methods.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "baton/graph.h"

namespace baton::partition_detail {

constexpr int kUnplaced = std::numeric_limits<int>::min();

struct Ctx {
  const Program& p;
  int S = 0;  // stages
  bool split = false;
  bool remat = true;
  std::vector<int> producer;                // value -> op or -1
  std::vector<std::vector<int>> consumers;  // value -> ops
  std::vector<int> pos;                     // staged value -> chain position
  std::vector<bool> staged_op;              // body op is staged
  std::vector<std::map<int, int>> upos;     // unstaged op -> stage -> position
  std::vector<int> fwd_marker, bwd_marker;  // k -> op index
  explicit Ctx(const Program& prog) : p(prog) {}

  int stage_of(int position) const { return position < S ? position : 2 * S - 1 - position; }
  bool is_fwd(int position) const { return position < S; }
  int f_pos(int s) const { return s; }
  int b_pos(int s) const { return 2 * S - 1 - s; }
  std::string op_label(int i) const { return fmt::format("op #{} ({})", i, p.ops[i].name); }
  std::string val_label(int v) const {
    const Value& val = p.values[v];
    std::string shape;
    for (size_t i = 0; i < val.shape.size(); ++i)
      shape += fmt::format("{}{}", i ? "," : "", val.shape[i]);
    return fmt::format("%{} ({}[{}])", v, val.dtype, shape);
  }
  std::string pos_label(int position) const {
    return fmt::format("{}{}", is_fwd(position) ? 'F' : 'B', stage_of(position));
  }
};

// Steps 1 and 2: which body ops are staged, and their chain positions.
void infer_stages(Ctx& c);

// Step 3: split summed loop outputs that add contributions of several stages.
void split_tied_sums(Ctx& c, std::vector<OutputPart>& parts);

// Step 4: place unstaged ops at their earliest consumer, per consuming stage.
void place_unstaged(Ctx& c, const std::vector<OutputPart>& parts);

// Step 5: task formation, interfaces and DCE. Sets `skips` to the edges
// between non-neighbouring stages (the plan's Plan::skips).
std::vector<TaskBody> form_tasks(Ctx& c, const std::vector<OutputPart>& parts,
                                 std::vector<SkipEdge>& skips);

// Step 6: stages of pre and post ops.
std::vector<int32_t> place_outer(const Ctx& c, const std::vector<TaskBody>& tasks,
                                 const std::vector<OutputPart>& parts);

}  // namespace baton::partition_detail
