// The partition does not depend on the order in which JAX emits equations:
// forward and backward of the last stage are told apart by data flow (what the
// primal loop outputs depend on), so any other topological order of the same
// ops gives the same tasks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "baton/graph.h"
#include "test_graph_util.h"

namespace baton {
namespace {

// loss = mean((tanh(x*w0) [boundary] * w1 - y)^2)-like MLP with its backward in
// JAX's order: every forward op first.
Program two_stage_mlp() {
  ProgramBuilder b;
  int w0 = b.loop_in(ValueKind::LoopInvariant);
  int w1 = b.loop_in(ValueKind::LoopInvariant);
  int x = b.loop_in(ValueKind::LoopMicrobatch);
  int lit = b.val(ValueKind::Literal);
  int z0 = b.op("mul", {x, w0});
  int h0 = b.op("tanh", {z0});
  int r0 = b.op("one_minus_square", {h0});
  int a0 = b.marker(0, false, h0);
  int z1 = b.op("mul", {a0, w1});
  int r1 = b.op("mul2", {z1});  // a residual only the backward reads
  int loss = b.op("reduce_sum", {z1});
  int seed = b.op("broadcast_in_dim", {lit});
  int d1 = b.op("mul", {seed, r1});
  int g1 = b.op("mul", {d1, a0});
  int ct = b.op("mul", {d1, w1});
  int c0 = b.marker(0, true, ct);
  int d0 = b.op("mul", {c0, r0});
  int g0 = b.op("mul", {d0, x});
  b.loop_out(loss, Reduce::Mean);
  b.loop_out(g0, Reduce::Mean);
  b.loop_out(g1, Reduce::Mean);
  b.p.num_primal_outputs = 1;
  return b.p;
}

// The same program with its ops in another topological order: Kahn's algorithm
// taking the most recently readied op first, which moves backward ops that only
// need literals and forward values ahead of the loss.
Program reordered(const Program& p, std::vector<int>& new_of_old) {
  const int n = static_cast<int>(p.ops.size());
  std::map<int, int> producer;
  for (int i = 0; i < n; ++i)
    for (int32_t v : p.ops[i].outputs) producer[v] = i;
  std::vector<int> missing(n, 0);
  std::vector<std::vector<int>> users(n);
  for (int i = 0; i < n; ++i)
    for (int32_t v : p.ops[i].inputs)
      if (auto it = producer.find(v); it != producer.end()) {
        ++missing[i];
        users[it->second].push_back(i);
      }
  std::vector<int> ready, order;
  for (int i = 0; i < n; ++i)
    if (missing[i] == 0) ready.push_back(i);
  while (!ready.empty()) {
    const int i = ready.back();
    ready.pop_back();
    order.push_back(i);
    for (int u : users[i])
      if (--missing[u] == 0) ready.push_back(u);
  }
  EXPECT_EQ(static_cast<int>(order.size()), n);
  Program q = p;
  q.ops.clear();
  new_of_old.assign(n, -1);
  for (int i : order) {
    new_of_old[i] = static_cast<int>(q.ops.size());
    q.ops.push_back(p.ops[i]);
  }
  q.validate();
  return q;
}

// The same program with op `i` moved to the end (valid when nothing reads it).
Program moved_last(const Program& p, int i, std::vector<int>& new_of_old) {
  const int n = static_cast<int>(p.ops.size());
  Program q = p;
  q.ops.clear();
  new_of_old.assign(n, -1);
  for (int k = 0; k < n; ++k)
    if (k != i) {
      new_of_old[k] = static_cast<int>(q.ops.size());
      q.ops.push_back(p.ops[k]);
    }
  new_of_old[i] = n - 1;
  q.ops.push_back(p.ops[i]);
  q.validate();
  return q;
}

std::vector<int> inverse(const std::vector<int>& new_of_old) {
  std::vector<int> old_of_new(new_of_old.size());
  for (size_t i = 0; i < new_of_old.size(); ++i) old_of_new[new_of_old[i]] = static_cast<int>(i);
  return old_of_new;
}

// Per task: the set of original op indices it runs.
std::map<std::string, std::set<int>> tasks_of(const Partition& part,
                                              const std::vector<int>& old_of_new) {
  std::map<std::string, std::set<int>> out;
  for (const TaskBody& t : part.tasks) {
    auto& s = out[fmt::format("{}{}", task_kind_char(t.kind), t.stage)];
    for (int32_t op : t.ops) s.insert(old_of_new.empty() ? op : old_of_new[op]);
  }
  return out;
}

TEST(GraphOrder, ShuffledTopologicalOrdersGiveTheSameTasks) {
  const Program p = two_stage_mlp();
  int loss_op = -1;
  for (size_t i = 0; i < p.ops.size(); ++i)
    if (p.ops[i].name == "reduce_sum") loss_op = static_cast<int>(i);
  ASSERT_GE(loss_op, 0);
  // two other valid orders: the loss computed last (after every gradient), and Kahn's
  // algorithm taking the most recently readied op first
  std::vector<int> moved, kahn;
  const Program q1 = moved_last(p, loss_op, moved);
  const Program q2 = reordered(p, kahn);
  ASSERT_NE(moved, kahn);
  {  // the program-order rule is fooled by the first (so this test can fail)
    Program q_unknown = q1;
    q_unknown.num_primal_outputs = -1;
    EXPECT_NE(tasks_of(partition(p, false, false), {}),
              tasks_of(partition(q_unknown, false, false), inverse(moved)));
  }
  for (const auto& [q, new_of_old] : {std::pair{q1, moved}, std::pair{q2, kahn}}) {
    for (bool split : {false, true}) {
      for (bool remat : {false, true}) {
        const Partition a = partition(p, split, remat);
        const Partition b = partition(q, split, remat);
        EXPECT_EQ(tasks_of(a, {}), tasks_of(b, inverse(new_of_old)))
            << "split " << split << " remat " << remat << "\n"
            << a.to_text(p) << "\n---\n"
            << b.to_text(q);
        // the loss is the last stage's forward output, its gradients the backward's
        EXPECT_TRUE(tasks_of(a, {}).at("F1").count(loss_op));
      }
    }
  }
}

TEST(GraphOrder, ProgramOrderRuleStillServesUnknownPrimalOutputs) {
  // num_primal_outputs unknown (-1): JAX's order (forward first) decides, as before
  Program p = two_stage_mlp();
  const Partition known = partition(p, false, false);
  p.num_primal_outputs = -1;
  const Partition by_order = partition(p, false, false);
  EXPECT_EQ(tasks_of(known, {}).at("F1").count(0), tasks_of(by_order, {}).at("F1").count(0));
  EXPECT_EQ(known.parts.size(), by_order.parts.size());
}

TEST(GraphOrder, PrimalCountBeyondTheOutputsIsRefused) {
  Program p = two_stage_mlp();
  p.num_primal_outputs = 7;
  EXPECT_THROW(partition(p, false, false), TraceError);
}

}  // namespace
}  // namespace baton
