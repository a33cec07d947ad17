// Lowering of a Schedule to per-rank instruction streams (semantics in plan.h).
#include <fmt/format.h>

#include "baton/error.h"
#include "baton/plan.h"

namespace baton {

namespace {

struct Lowering {
  const Plan& plan;

  BufKind kind_of(int32_t id) const { return plan.buffer_key(id).kind; }
  static bool is_transfer(BufKind k) { return Plan::is_transfer(k); }
  // Ranks of the tasks producing / consuming a transfer buffer (every
  // produced one has a consumer).
  int32_t producer(int32_t id) const { return plan.producer_rank(id); }
  int32_t consumer(int32_t id) const { return plan.consumer_rank(id); }

  void lower_rank(int32_t r, std::vector<Instr>& prog) const {
    const auto& row = plan.schedule.rank_actions[r];
    prog.reserve(row.size() * 7 + 4);
    // Buffers sent by the previous action: freed after the communication
    // group that holds their SENDs and this action's RECVs.
    int32_t sent[Plan::kMaxIO];
    int n_sent = 0;
    auto emit = [&](OpCode op, int32_t action, int32_t buffer, int32_t peer) {
      prog.push_back(Instr{op, action, buffer, peer});
    };
    for (int32_t k = 0; k < static_cast<int32_t>(row.size()); ++k) {
      const Plan::ActionIO io = plan.action_io(row[k]);
      for (int i = 0; i < io.n_in; ++i) {
        const int32_t b = io.in[i];
        if (!is_transfer(kind_of(b))) continue;
        const int32_t src = producer(b);
        if (src != r) emit(OpCode::Recv, -1, b, src);
      }
      for (int i = 0; i < n_sent; ++i) emit(OpCode::Free, -1, sent[i], -1);
      n_sent = 0;
      emit(OpCode::Run, k, -1, -1);
      // Every buffer has a single consumer task, so this action is the last
      // (only) local use of each of its inputs; a local hand-off is freed here
      // by its consumer.
      for (int i = 0; i < io.n_in; ++i) emit(OpCode::Free, -1, io.in[i], -1);
      for (int i = 0; i < io.n_internal; ++i) emit(OpCode::Free, -1, io.internal[i], -1);
      for (int i = 0; i < io.n_out; ++i) {
        const int32_t b = io.out[i];
        if (kind_of(b) != BufKind::WGrad) continue;
        emit(OpCode::Accumulate, -1, b, -1);
        emit(OpCode::Free, -1, b, -1);
      }
      for (int i = 0; i < io.n_out; ++i) {
        const int32_t b = io.out[i];
        if (!is_transfer(kind_of(b))) continue;
        bool internal = false;
        for (int j = 0; j < io.n_internal; ++j) internal |= io.internal[j] == b;
        if (internal) continue;
        const int32_t dst = consumer(b);
        if (dst == r) continue;  // local hand-off
        emit(OpCode::Send, -1, b, dst);
        sent[n_sent++] = b;
      }
    }
    for (int i = 0; i < n_sent; ++i) emit(OpCode::Free, -1, sent[i], -1);
  }
};

void check_skips(const Schedule& s, const std::vector<SkipEdge>& skips) {
  if (static_cast<int>(skips.size()) > kMaxSkipEdges)
    throw ScheduleError(fmt::format("{} skip edges: at most {} are supported", skips.size(),
                                    kMaxSkipEdges));
  for (size_t i = 0; i < skips.size(); ++i) {
    const SkipEdge& e = skips[i];
    if (!e.forward && !e.backward)
      throw ScheduleError(fmt::format("skip edge {} (stage {} -> stage {}) carries nothing: "
                                      "neither forward nor backward",
                                      i, e.from, e.to));
    if (e.from < 0 || e.from + 1 >= e.to || e.to >= s.num_stages)
      throw ScheduleError(fmt::format(
          "skip edge {} (stage {} -> stage {}) must join a stage to a later stage that is not "
          "its neighbour (stages 0..{})",
          i, e.from, e.to, s.num_stages - 1));
    if (i > 0 && !(skips[i - 1].from < e.from ||
                   (skips[i - 1].from == e.from && skips[i - 1].to < e.to)))
      throw ScheduleError(fmt::format(
          "skip edges must be sorted by (from, to) and distinct: edge {} (s{}->s{}) follows "
          "s{}->s{}",
          i, e.from, e.to, skips[i - 1].from, skips[i - 1].to));
  }
}

}  // namespace

Plan lower(const Schedule& s, const std::vector<SkipEdge>& skips) {
  build_counters().lower.fetch_add(1, std::memory_order_relaxed);
  s.validate();
  check_skips(s, skips);
  Plan plan;
  plan.schedule = s;
  plan.skips = skips;
  plan.programs.resize(s.num_ranks);
  const Lowering low{plan};
  for (int32_t r = 0; r < s.num_ranks; ++r) low.lower_rank(r, plan.programs[r]);
  return plan;
}

}  // namespace baton
