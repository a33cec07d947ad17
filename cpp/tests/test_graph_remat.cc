// Stash rematerialization (min_stash, and partition() with remat on).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "baton/graph.h"
#include "test_graph_util.h"

namespace baton {
namespace {

// Values of 1 KiB unless sized otherwise.
struct G : ProgramBuilder {
  G() { bytes = 1024; }
};

// Stage 0 is a dense layer with a tanh-approximated GELU, whose linearization
// keeps several elementwise residuals; stage 1 a dense layer and the loss.
struct Gelu {
  G g;
  int x, w0, b0, w1, lit, z, h, t, s, act, loss;
  Gelu() {
    w0 = g.loop_in(ValueKind::LoopInvariant);
    b0 = g.loop_in(ValueKind::LoopInvariant);
    w1 = g.loop_in(ValueKind::LoopInvariant);
    x = g.loop_in(ValueKind::LoopMicrobatch);
    lit = g.val(ValueKind::Literal, 4);
    z = g.op("dot_general", {x, w0});
    h = g.op("add", {z, b0});
    int h3 = g.op("integer_pow", {h});
    int inner = g.op("add", {h, h3});
    t = g.op("tanh", {inner});
    s = g.op("add", {lit, t});
    int y = g.op("mul", {h, s});
    act = g.marker(0, false, y);
    int z1 = g.op("dot_general", {act, w1});
    loss = g.sized("reduce_sum", {z1}, 4);
    // backward: stage 1 then stage 0 (reads t, s, h and h3's derivative)
    int seed = g.op("broadcast_in_dim", {lit});
    int gw1 = g.op("dot_general", {seed, act});
    int ct_act = g.op("dot_general", {seed, w1});
    int c0 = g.marker(0, true, ct_act);
    int d_s = g.op("mul", {c0, h});
    int d_h1 = g.op("mul", {c0, s});
    int one_m_t2 = g.op("sub", {lit, g.op("mul", {t, t})});
    int d_inner = g.op("mul", {d_s, one_m_t2});
    int d_h = g.op("add", {d_h1, g.op("mul", {d_inner, g.op("mul", {h, h})})});
    int gw0 = g.op("dot_general", {x, d_h});
    g.loop_out(loss, Reduce::Mean);
    g.loop_out(gw0, Reduce::Mean);
    g.loop_out(gw1, Reduce::Mean);
  }
};

int64_t bytes(const Program& p, const std::vector<int32_t>& vs) {
  int64_t n = 0;
  for (int32_t v : vs) n += p.values[v].bytes;
  return n;
}

TEST(GraphRemat, GeluStashesOnlyTheLayerOutput) {
  Gelu m;
  Partition plain = partition(m.g.p, false, false);
  Partition remat = partition(m.g.p, false);
  const TaskBody& b0_plain = plain.task(TaskKind::B, 0);
  const TaskBody& b0 = remat.task(TaskKind::B, 0);
  const TaskBody& f0 = remat.task(TaskKind::F, 0);
  // Without remat B0 reads h, t and s (three residuals of 1 KiB each).
  EXPECT_EQ(b0_plain.stash_in, (std::vector<int32_t>{m.h, m.t, m.s})) << plain.to_text(m.g.p);
  // With remat: only h (the dense output; z would cost the same but needs one
  // more recomputed op), and B0 reruns pow, add, tanh, add.
  EXPECT_EQ(b0.stash_in, std::vector<int32_t>{m.h}) << remat.to_text(m.g.p);
  EXPECT_EQ(f0.stash_out, b0.stash_in);
  EXPECT_EQ(bytes(m.g.p, b0.stash_in) * 3, bytes(m.g.p, b0_plain.stash_in));
  EXPECT_EQ(b0.ops.size(), b0_plain.ops.size() + 4) << remat.to_text(m.g.p);
  EXPECT_TRUE(std::is_sorted(b0.ops.begin(), b0.ops.end()));
  EXPECT_DOUBLE_EQ(b0.cost, b0_plain.cost + 4);
  // Every input a recomputed op reads is a stash value, a free input or an
  // earlier op's output in B0.
  std::set<int32_t> have(b0.stash_in.begin(), b0.stash_in.end());
  have.insert(b0.grad_in.begin(), b0.grad_in.end());
  have.insert(b0.invariant_in.begin(), b0.invariant_in.end());
  have.insert(b0.microbatch_in.begin(), b0.microbatch_in.end());
  for (int o : b0.ops) {
    for (int32_t v : m.g.p.ops[o].inputs) {
      EXPECT_TRUE(have.count(v) || m.g.p.values[v].kind == ValueKind::Literal)
          << "op " << o << " reads %" << v << "\n"
          << remat.to_text(m.g.p);
    }
    for (int32_t v : m.g.p.ops[o].outputs) have.insert(v);
  }
  // The last stage's stash (the received activation) is not recomputable.
  EXPECT_EQ(remat.task(TaskKind::B, 1).stash_in, plain.task(TaskKind::B, 1).stash_in);
}

TEST(GraphRemat, SplitBackwardRecomputesInI) {
  Gelu m;
  Partition remat = partition(m.g.p, true);
  const TaskBody& f0 = remat.task(TaskKind::F, 0);
  const TaskBody& i0 = remat.task(TaskKind::I, 0);
  const TaskBody& w0 = remat.task(TaskKind::W, 0);
  EXPECT_EQ(f0.stash_out, std::vector<int32_t>{m.h}) << remat.to_text(m.g.p);
  EXPECT_EQ(i0.stash_in, f0.stash_out);
  EXPECT_EQ(w0.stash_in, std::vector<int32_t>{});
  EXPECT_EQ(i0.wstash_out, w0.wstash_in);
}

TEST(GraphRemat, MinStashKeepsTheSmallerSideOfABroadcast) {
  G g;
  int x = g.loop_in(ValueKind::LoopMicrobatch);
  int small = g.sized("reduce_sum", {x}, 16);      // not recomputable
  int big = g.op("broadcast_in_dim", {small});     // recomputable, 1 KiB
  int big2 = g.op("exp", {big});                   // recomputable, 1 KiB
  int dot = g.sized("dot_general", {x, x}, 4096);  // not recomputable: stashed as is
  std::vector<int32_t> producer(g.p.values.size(), -1);
  std::set<int32_t> fwd;
  for (int i = 0; i < static_cast<int>(g.p.ops.size()); ++i) {
    for (int32_t v : g.p.ops[i].outputs) producer[v] = i;
    fwd.insert(i);
  }
  Remat r = min_stash(g.p, producer, fwd, {big, big2, dot});
  EXPECT_EQ(r.stash, (std::vector<int32_t>{small, dot}));
  EXPECT_EQ(r.recompute, (std::vector<int32_t>{producer[big], producer[big2]}));
  // Ops outside the forward task are never recomputed; at equal bytes the
  // value itself is stashed rather than recomputed.
  fwd.erase(producer[big]);
  r = min_stash(g.p, producer, fwd, {big2});
  EXPECT_EQ(r.stash, std::vector<int32_t>{big2});
  EXPECT_TRUE(r.recompute.empty());
  r = min_stash(g.p, producer, fwd, {big, big2});
  EXPECT_EQ(r.stash, std::vector<int32_t>{big});
  EXPECT_EQ(r.recompute, std::vector<int32_t>{producer[big2]});
  EXPECT_TRUE(is_recomputable(g.p.ops[producer[big]]));
  EXPECT_FALSE(is_recomputable(g.p.ops[producer[small]]));
}

}  // namespace
}  // namespace baton
