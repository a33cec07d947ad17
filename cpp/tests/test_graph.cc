// Tests of the program IR and the partition passes on hand-built programs that
// mirror what the JAX frontend exports for a small MLP.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "baton/graph.h"
#include "test_graph_util.h"

namespace baton {
namespace {

using Builder = ProgramBuilder;

// loss = sum(tanh(tanh(x*w0) [boundary 0] * w1) [boundary 1] * w2)
// with a hand-written backward in JAX's order (forward first).
struct Mlp {
  Builder b;
  int w[3], x, h0, a0, h1, a1, loss, g[3];
  explicit Mlp(int stages = 3, bool tied = false) {
    for (int i = 0; i < 3; ++i) w[i] = b.loop_in(ValueKind::LoopInvariant);
    x = b.loop_in(ValueKind::LoopMicrobatch);
    int lit = b.val(ValueKind::Literal);
    int z0 = b.op("mul", {x, w[0]});
    h0 = b.op("tanh", {z0});
    int r0 = b.op("one_minus_square", {h0});
    a0 = b.marker(0, false, h0);
    int z1 = b.op("mul", {a0, tied ? w[0] : w[1]});
    h1 = b.op("tanh", {z1});
    int r1 = b.op("one_minus_square", {h1});
    a1 = stages == 3 ? b.marker(1, false, h1) : h1;
    int z2 = b.op("mul", {a1, w[2]});
    loss = b.op("reduce_sum", {z2});
    // backward
    int seed = b.op("broadcast_in_dim", {lit});
    g[2] = b.op("mul", {seed, a1});
    int ct_a1 = b.op("mul", {seed, w[2]});
    int c1 = stages == 3 ? b.marker(1, true, ct_a1) : ct_a1;
    int d1 = b.op("mul", {c1, r1});
    int g1 = b.op("mul", {d1, a0});
    int ct_a0 = b.op("mul", {d1, tied ? w[0] : w[1]});
    int c0 = b.marker(0, true, ct_a0);
    int d0 = b.op("mul", {c0, r0});
    int g0 = b.op("mul", {d0, x});
    if (tied) {
      g[0] = b.op("add_any", {g0, g1}, 1.0, OpKind::AddAny);
      g[1] = b.op("broadcast_in_dim", {lit});
    } else {
      g[0] = g0;
      g[1] = g1;
    }
    b.loop_out(loss, Reduce::Mean);
    for (int i = 0; i < 3; ++i) b.loop_out(g[i], Reduce::Mean);
  }
};

TEST(Graph, ValidateAndPrint) {
  Mlp m;
  EXPECT_NO_THROW(m.b.p.validate());
  std::string text = m.b.p.to_text();
  EXPECT_NE(text.find("stage_boundary[bwd 1]"), std::string::npos);
  EXPECT_EQ(count_stages(m.b.p), 3);
}

TEST(Graph, ValidateRejectsUseBeforeDef) {
  Builder b;
  int x = b.loop_in(ValueKind::LoopMicrobatch);
  int later = b.val();
  Op o;
  o.name = "add";
  o.inputs = {x, later};
  o.outputs = {b.val()};
  b.p.add_op(o);
  EXPECT_THROW(b.p.validate(), TraceError);
}

TEST(Graph, ThreeStagesFullBackward) {
  Mlp m;
  // Without rematerialization: the stash is exactly what B reads (see test_graph_remat.cc).
  Partition part = partition(m.b.p, false, false);
  ASSERT_EQ(part.num_stages, 3);
  ASSERT_EQ(part.tasks.size(), 6u);
  const TaskBody& f0 = part.task(TaskKind::F, 0);
  const TaskBody& f2 = part.task(TaskKind::F, 2);
  const TaskBody& b2 = part.task(TaskKind::B, 2);
  const TaskBody& b0 = part.task(TaskKind::B, 0);
  EXPECT_EQ(f0.act_out, std::vector<int32_t>{m.h0});
  EXPECT_TRUE(f0.act_in.empty());
  EXPECT_EQ(f0.microbatch_in, std::vector<int32_t>{m.x});
  EXPECT_EQ(f0.invariant_in, std::vector<int32_t>{m.w[0]});
  // The loss is produced by the last forward, its gradient by the last backward.
  ASSERT_EQ(f2.mb_out.size(), 1u);
  EXPECT_EQ(part.parts[f2.mb_out[0]].body, m.loss);
  ASSERT_EQ(b2.wgrad_out.size(), 1u);
  EXPECT_EQ(part.parts[b2.wgrad_out[0]].body, m.g[2]);
  // B2 needs a1 (the activation it received) from F2's stash.
  EXPECT_EQ(b2.stash_in, std::vector<int32_t>{m.a1});
  EXPECT_EQ(f2.stash_out, b2.stash_in);
  EXPECT_TRUE(b2.grad_in.empty());
  EXPECT_EQ(b2.grad_out.size(), 1u);
  EXPECT_TRUE(b0.grad_out.empty());
  EXPECT_EQ(b0.grad_in.size(), 1u);
  // B0 reads x directly and the tanh residual from the stash.
  EXPECT_EQ(b0.microbatch_in, std::vector<int32_t>{m.x});
  EXPECT_EQ(b0.stash_in.size(), 1u) << part.to_text(m.b.p);
  for (const TaskBody& t : part.tasks) EXPECT_FALSE(t.ops.empty()) << part.to_text(m.b.p);
}

TEST(Graph, SplitBackwardFormsIandW) {
  Mlp m;
  Partition part = partition(m.b.p, true, false);
  ASSERT_EQ(part.tasks.size(), 9u);
  const TaskBody& i1 = part.task(TaskKind::I, 1);
  const TaskBody& w1 = part.task(TaskKind::W, 1);
  EXPECT_EQ(i1.grad_out.size(), 1u);
  EXPECT_TRUE(w1.grad_out.empty());
  ASSERT_EQ(w1.wgrad_out.size(), 1u);
  EXPECT_EQ(part.parts[w1.wgrad_out[0]].body, m.g[1]);
  EXPECT_EQ(i1.wstash_out, w1.wstash_in);
  EXPECT_FALSE(w1.wstash_in.empty());
  // I of stage 0 has nothing to compute: W does all.
  EXPECT_TRUE(part.task(TaskKind::I, 0).ops.empty());
  EXPECT_FALSE(part.task(TaskKind::W, 0).ops.empty());
  // Cost is conserved: I + W == B.
  Partition full = partition(m.b.p, false, false);
  for (int s = 0; s < 3; ++s) {
    EXPECT_DOUBLE_EQ(part.task(TaskKind::I, s).cost + part.task(TaskKind::W, s).cost,
                     full.task(TaskKind::B, s).cost);
  }
}

TEST(Graph, TiedWeightGradientIsSplitAcrossStages) {
  Mlp m(3, true);
  Partition part = partition(m.b.p, false);
  int n = 0;
  std::vector<int> stages;
  for (const OutputPart& o : part.parts) {
    if (o.outer == m.b.p.loop_outputs[1].outer) {
      ++n;
      stages.push_back(o.stage);
    }
  }
  EXPECT_EQ(n, 2);
  EXPECT_NE(stages[0], stages[1]);
}

// loss = sum(tanh(x*w0) * w1) with no stage_boundary: a one-stage pipeline.
struct OneStage {
  Builder b;
  int w0, w1, x, h0, r0, loss, seed, ct_h0, g0, g1;
  OneStage() {
    w0 = b.loop_in(ValueKind::LoopInvariant);
    w1 = b.loop_in(ValueKind::LoopInvariant);
    x = b.loop_in(ValueKind::LoopMicrobatch);
    int lit = b.val(ValueKind::Literal);
    h0 = b.op("tanh", {b.op("mul", {x, w0})});
    r0 = b.op("one_minus_square", {h0});
    loss = b.op("reduce_sum", {b.op("mul", {h0, w1})});
    // backward
    seed = b.op("broadcast_in_dim", {lit});
    g1 = b.op("mul", {seed, h0});
    ct_h0 = b.op("mul", {seed, w1});  // invariants and literals only: unstaged
    int d0 = b.op("mul", {ct_h0, r0});
    g0 = b.op("mul", {d0, x});
    b.loop_out(loss, Reduce::Mean);
    b.loop_out(g0, Reduce::Mean);
    b.loop_out(g1, Reduce::Mean);
  }
};

TEST(Graph, NoBoundaryIsOneStage) {
  OneStage m;
  EXPECT_EQ(count_stages(m.b.p), 1);
  // Without rematerialization, so that the stash is exactly the residuals.
  Partition part = partition(m.b.p, false, false);
  ASSERT_EQ(part.num_stages, 1) << part.to_text(m.b.p);
  ASSERT_EQ(part.tasks.size(), 2u);
  const TaskBody& f0 = part.task(TaskKind::F, 0);
  const TaskBody& b0 = part.task(TaskKind::B, 0);
  // F0: the forward (5 ops), ending in the loss; B0: the backward (5 ops).
  EXPECT_EQ(f0.ops.size(), 5u) << part.to_text(m.b.p);
  EXPECT_EQ(b0.ops.size(), 5u) << part.to_text(m.b.p);
  ASSERT_EQ(f0.mb_out.size(), 1u);
  EXPECT_EQ(part.parts[f0.mb_out[0]].body, m.loss);
  ASSERT_EQ(b0.wgrad_out.size(), 2u);
  EXPECT_EQ(part.parts[b0.wgrad_out[0]].body, m.g0);
  EXPECT_EQ(part.parts[b0.wgrad_out[1]].body, m.g1);
  // Residuals travel F0 -> B0 in the stash; no activation or gradient buffers.
  EXPECT_EQ(b0.stash_in, (std::vector<int32_t>{m.h0, m.r0}));
  EXPECT_EQ(f0.stash_out, b0.stash_in);
  for (const TaskBody& t : part.tasks) {
    EXPECT_TRUE(t.act_in.empty() && t.act_out.empty() && t.grad_in.empty() && t.grad_out.empty());
  }
  EXPECT_EQ(f0.microbatch_in, std::vector<int32_t>{m.x});
  EXPECT_EQ(f0.invariant_in, (std::vector<int32_t>{m.w0, m.w1}));
  EXPECT_EQ(b0.microbatch_in, std::vector<int32_t>{m.x});
  EXPECT_EQ(b0.invariant_in, std::vector<int32_t>{m.w1});
  EXPECT_DOUBLE_EQ(f0.cost + b0.cost, 10.0);

  Partition split = partition(m.b.p, true, false);
  ASSERT_EQ(split.num_stages, 1);
  ASSERT_EQ(split.tasks.size(), 3u);
  const TaskBody& i0 = split.task(TaskKind::I, 0);
  const TaskBody& w0 = split.task(TaskKind::W, 0);
  // No upstream stage: I0 computes nothing, W0 all of the backward.
  EXPECT_TRUE(i0.ops.empty());
  EXPECT_TRUE(i0.grad_out.empty());
  EXPECT_EQ(w0.ops.size(), 5u);
  EXPECT_EQ(w0.wgrad_out.size(), 2u);
  EXPECT_FALSE(split.task(TaskKind::F, 0).stash_out.empty());
  EXPECT_EQ(i0.wstash_out, w0.wstash_in);
  EXPECT_DOUBLE_EQ(i0.cost + w0.cost, b0.cost);

  // With rematerialization (the default) the shape is the same: F0 and B0,
  // the loss from F0, the gradients from B0, and a consistent stash.
  for (bool split_backward : {false, true}) {
    Partition r = partition(m.b.p, split_backward);
    ASSERT_EQ(r.num_stages, 1);
    ASSERT_EQ(r.tasks.size(), split_backward ? 3u : 2u);
    const TaskBody& rf = r.task(TaskKind::F, 0);
    const TaskBody& rb = r.task(split_backward ? TaskKind::I : TaskKind::B, 0);
    ASSERT_EQ(rf.mb_out.size(), 1u);
    EXPECT_EQ(r.parts[rf.mb_out[0]].body, m.loss);
    EXPECT_EQ(rf.stash_out, rb.stash_in);
    EXPECT_FALSE(rf.stash_out.empty()) << r.to_text(m.b.p);
  }
}

TEST(Graph, ErrorsNameTheProblem) {
  {
    // No stage_boundary is not an error: one stage, forward only here.
    Builder b;
    int x = b.loop_in(ValueKind::LoopMicrobatch);
    int y = b.op("tanh", {x});
    b.loop_out(y, Reduce::Sum);
    Partition part = partition(b.p, false);
    EXPECT_EQ(part.num_stages, 1);
    EXPECT_EQ(part.task(TaskKind::F, 0).ops.size(), 1u);
    EXPECT_TRUE(part.task(TaskKind::B, 0).ops.empty());
  }
  {
    // Skip connections: stage 0's h used in stage 2 goes on the skip edge
    // 0 -> 2 (skip_out of F0, skip_in of F2), not through stage 1; stage 1's
    // h1, passed through boundary 1 and also used directly by stage 2, goes
    // with the activations.
    Builder b;
    int x = b.loop_in(ValueKind::LoopMicrobatch);
    int h = b.op("dot_general", {x});  // stage 0's work (a cheap op would be recomputed)
    int a = b.marker(0, false, h);
    int h1 = b.op("tanh", {a});
    int a1 = b.marker(1, false, h1);
    int y = b.op("add", {a1, h1});
    int z = b.op("mul", {y, h});
    b.loop_out(z, Reduce::Sum);
    Partition part = partition(b.p, false);
    ASSERT_EQ(part.num_stages, 3);
    const TaskBody& f0 = part.task(TaskKind::F, 0);
    const TaskBody& f1 = part.task(TaskKind::F, 1);
    const TaskBody& f2 = part.task(TaskKind::F, 2);
    EXPECT_EQ(f0.act_out, (std::vector<int32_t>{h}));
    EXPECT_EQ(f1.act_in, (std::vector<int32_t>{a}));
    EXPECT_EQ(f1.act_out, (std::vector<int32_t>{h1, h1}));
    EXPECT_EQ(f2.act_in, (std::vector<int32_t>{a1, h1}));
    ASSERT_EQ(part.skips.size(), 1u);
    EXPECT_EQ(part.skips[0], (SkipEdge{0, 2, true, false}));  // no backward here
    ASSERT_EQ(f0.skip_out.size(), 1u);
    EXPECT_EQ(f0.skip_out[0].values, (std::vector<int32_t>{h}));
    ASSERT_EQ(f2.skip_in.size(), 1u);
    EXPECT_EQ(f2.skip_in[0].values, (std::vector<int32_t>{h}));
    EXPECT_TRUE(f1.skip_in.empty() && f1.skip_out.empty());
    EXPECT_EQ(f2.ops.size(), 2u) << part.to_text(b.p);
  }
  {
    // Empty stage: two boundaries in a row.
    Builder b;
    int x = b.loop_in(ValueKind::LoopMicrobatch);
    int h = b.op("tanh", {x});
    int a = b.marker(0, false, h);
    int a1 = b.marker(1, false, a);
    int y = b.op("tanh", {a1});
    b.loop_out(y, Reduce::Sum);
    try {
      partition(b.p, false);
      FAIL();
    } catch (const TraceError& e) {
      EXPECT_NE(std::string(e.what()).find("stage 1 has no work"), std::string::npos) << e.what();
    }
  }
}

TEST(Graph, BackwardRecomputeMapsToItsOwnStage) {
  // Like jax.checkpoint: stage 1's backward recomputes from its stashed input
  // after the cut; the recompute belongs to B1, not to the last stage's B2.
  Builder b;
  int w = b.loop_in(ValueKind::LoopInvariant);
  int x = b.loop_in(ValueKind::LoopMicrobatch);
  int lit = b.val(ValueKind::Literal);
  int a0 = b.marker(0, false, b.op("tanh", {b.op("mul", {x, w})}));
  int a1 = b.marker(1, false, b.op("tanh", {a0}));
  int loss = b.op("reduce_sum", {b.op("tanh", {a1})});
  int seed = b.op("broadcast_in_dim", {lit});
  int c1 = b.marker(1, true, b.op("mul", {seed, a1}));
  b.marker(0, true, b.op("mul", {c1, a0}));
  int re = b.op("remat_tanh", {a0});  // recompute of stage 1 from its input
  int g = b.op("mul", {c1, re});
  b.loop_out(loss, Reduce::Mean);
  b.loop_out(g, Reduce::Mean);
  Partition part = partition(b.p, false);
  EXPECT_EQ(part.task(TaskKind::B, 1).ops.size(), 3u) << part.to_text(b.p);
  EXPECT_EQ(part.task(TaskKind::B, 2).ops.size(), 2u) << part.to_text(b.p);
  EXPECT_EQ(part.task(TaskKind::B, 1).stash_in, std::vector<int32_t>{a0});
}

TEST(Graph, BatchOnlyValueIsRecomputedPerStage) {
  // A value computed from the batch alone (labels preprocessing) used by the
  // first and the last stage is computed by both, not sent (cheap ops; stage
  // 0's expensive work on the way to its boundary is sent instead).
  Builder b;
  int x = b.loop_in(ValueKind::LoopMicrobatch);
  int lab = b.op("eq", {x});  // one_hot: eq of an iota, then a convert
  int a0 = b.marker(0, false, b.op("mul", {x, lab}));
  int y = b.op("mul", {a0, lab});
  b.loop_out(y, Reduce::Sum);
  Partition part = partition(b.p, false);
  int onehot_op = 0;
  for (int s = 0; s < 2; ++s) {
    const auto& ops = part.task(TaskKind::F, s).ops;
    EXPECT_NE(std::find(ops.begin(), ops.end(), onehot_op), ops.end()) << "stage " << s;
  }
}

TEST(Graph, OuterOpsFollowTheirStage) {
  Mlp m;
  Builder& b = m.b;
  b.region = Region::Post;
  // sgd update per parameter: w - g
  std::vector<int> upd;
  for (int i = 0; i < 3; ++i) {
    upd.push_back(b.op("sub", {b.p.loop_inputs[i].outer, b.p.loop_outputs[i + 1].outer}));
  }
  int count = b.op("add", {b.val(ValueKind::StepInput)});
  b.p.step_outputs = {upd[0], upd[1], upd[2], count};
  Partition part = partition(b.p, false);
  size_t n = b.p.ops.size();
  EXPECT_EQ(part.op_stage[n - 4], 0);
  EXPECT_EQ(part.op_stage[n - 3], 1);
  EXPECT_EQ(part.op_stage[n - 2], 2);
  EXPECT_EQ(part.op_stage[n - 1], 0);
}

}  // namespace
}  // namespace baton
