// Lowering of a Schedule to per-rank instruction streams (semantics in plan.h).
#include "baton/plan.h"

namespace baton {

namespace {

struct Lowering {
  const Plan& plan;
  int32_t S, M;

  BufKind kind_of(int32_t id) const { return static_cast<BufKind>(id / M / S); }
  int32_t stage_of(int32_t id) const { return (id / M) % S; }
  // Rank of the task producing an act/grad buffer.
  int32_t producer(int32_t id) const { return plan.schedule.stage_rank[stage_of(id)]; }
  // Rank of the task consuming an act/grad buffer (every produced one has a consumer).
  int32_t consumer(int32_t id) const {
    const int32_t s = stage_of(id);
    return plan.schedule.stage_rank[kind_of(id) == BufKind::Act ? s + 1 : s - 1];
  }
  static bool is_transfer(BufKind k) { return k == BufKind::Act || k == BufKind::Grad; }

  void lower_rank(int32_t r, std::vector<Instr>& prog) const {
    const auto& row = plan.schedule.rank_actions[r];
    prog.reserve(row.size() * 7 + 4);
    // Buffers sent by the previous action: freed after the communication
    // group that holds their SENDs and this action's RECVs.
    int32_t sent[4];
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

}  // namespace

Plan lower(const Schedule& s) {
  s.validate();
  Plan plan;
  plan.schedule = s;
  plan.programs.resize(s.num_ranks);
  const Lowering low{plan, s.num_stages, s.num_microbatches};
  for (int32_t r = 0; r < s.num_ranks; ++r) low.lower_rank(r, plan.programs[r]);
  return plan;
}

}  // namespace baton
