// Verifier, data and buffer checks: one pass per rank in program order that
// every buffer exists when it is used and is freed exactly once after its last
// use; it also numbers the SEND/RECV ops and their groups for the later passes.
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "verify_internal.h"

namespace baton::verify_detail {

std::string Verifier::later_or_never(int r, int i, int32_t b) const {
  const auto& prog = plan_.programs[r];
  for (int j = i + 1; j < static_cast<int>(prog.size()); ++j) {
    const Instr& in = prog[j];
    if (in.op == OpCode::Recv && in.buffer == b) return fmt::format("received later at #{}", j);
    if (in.op == OpCode::Run && run_produces(r, j, b))
      return fmt::format("produced later at #{} ({})", j, op_text(r, j));
  }
  const int pr = plan_.producer_rank(b);
  if (pr == r) return fmt::format("never produced on rank {}", r);
  const auto& pprog = plan_.programs[pr];
  for (int j = 0; j < static_cast<int>(pprog.size()); ++j) {
    const Instr& in = pprog[j];
    if (in.op == OpCode::Send && in.buffer == b && in.peer == r)
      return fmt::format("never received by rank {} (rank {} sends it at #{})", r, pr, j);
  }
  return fmt::format("never received by rank {} (its producer on rank {} never sends it there)", r,
                     pr);
}

void Verifier::static_pass(bool report) {
  const int R = s_.num_ranks;
  const int32_t nbuf = plan_.num_buffer_ids();
  bufs_.assign(nbuf, BufState{});
  BufState* bs = bufs_.data();
  std::vector<int32_t> touched;
  first_bad_run_.assign(R, std::numeric_limits<int32_t>::max());
  rank_group_begin_.assign(R + 1, 0);
  n_ops_ = 0;
  chan_k_.clear();
  groups_.clear();
  size_t n_instr = 0;
  for (const auto& prog : plan_.programs) n_instr += prog.size();
  op_group_.clear();
  opi_.clear();
  eager_.clear();
  // Lowered plans have about one SEND or RECV in four instructions.
  op_group_.reserve(n_instr / 3);
  opi_.reserve(n_instr / 3);
  groups_.reserve(n_instr / 5);

  for (int r = 0; r < R; ++r) {
    rank_group_begin_[r] = static_cast<int32_t>(groups_.size());
    const auto& prog = plan_.programs[r];
    const int n = static_cast<int>(prog.size());
    touched.clear();
    auto touch = [&](int32_t b) {
      if (bs[b].first_send == 0) return;
      bs[b].first_send = 0;
      touched.push_back(b);
    };
    auto mark_bad_run = [&](int i, int32_t b) {
      if (!missing_input_.count({r, i})) missing_input_[{r, i}] = b;
      first_bad_run_[r] = std::min(first_bad_run_[r], static_cast<int32_t>(i));
    };
    int group_start = -1;
    for (int i = 0; i < n; ++i) {
      const Instr& in = prog[i];
      if (is_comm(in.op)) {
        if (i == 0 || !is_comm(prog[i - 1].op)) {
          group_start = i;
          groups_.push_back(Group{r, i, i, n_ops_, 0});
        }
        Group& g = groups_.back();
        g.end = i + 1;
        ++g.n_ops;
        ++n_ops_;
        op_group_.push_back(static_cast<int32_t>(groups_.size()) - 1);
        opi_.push_back(OpInfo{in.buffer, in.peer, r, in.op == OpCode::Send});
        eager_.push_back(in.op == OpCode::Send && in.buffer >= 0 && in.buffer < nbuf &&
                         is_skip(in.buffer));
      }
      switch (in.op) {
        case OpCode::Run: {
          const Action& a = s_.rank_actions[r][in.action];
          const Plan::ActionIO io = plan_.action_io(a);
          for (int k = 0; k < io.n_in; ++k) {
            const int32_t b = io.in[k];
            touch(b);
            if (bs[b].have < 0) {
              mark_bad_run(i, b);
              if (report && !full()) {
                const BufferKey bk = key(b);
                add("data",
                    fmt::format("data: {} needs {}, which is {}", d(r, i), buf(b),
                                later_or_never(r, i, b)),
                    {r}, {i}, bk.stage, bk.microbatch);
              }
            } else if (bs[b].freed >= 0 && report && !full()) {
              const BufferKey bk = key(b);
              add("buffer",
                  fmt::format("buffer: {} uses {} after {} (freed before its last use)", d(r, i),
                              buf(b), d(r, bs[b].freed)),
                  {r, r}, {bs[b].freed, i}, bk.stage, bk.microbatch);
            }
          }
          for (int k = 0; k < io.n_out; ++k) {
            const int32_t b = io.out[k];
            touch(b);
            if (bs[b].have >= 0) {
              if (report && !full()) {
                add("data",
                    fmt::format("data: {} produces {}, which already exists on rank {} (since #{})",
                                d(r, i), buf(b), r, bs[b].have),
                    {r, r}, {bs[b].have, i}, key(b).stage, key(b).microbatch);
              }
            } else {
              bs[b].have = i;
            }
          }
          break;
        }
        case OpCode::Recv: {
          const int32_t b = in.buffer;
          touch(b);
          if (bs[b].have >= 0) {
            if (report && !full())
              add("data",
                  fmt::format("data: {} receives {}, which already exists on rank {} (since #{})",
                              d(r, i), buf(b), r, bs[b].have),
                  {r, r}, {bs[b].have, i}, key(b).stage, key(b).microbatch);
          } else {
            bs[b].have = i;
          }
          break;
        }
        case OpCode::Send: {
          const int32_t b = in.buffer;
          touch(b);
          if (!report || full()) break;
          if (bs[b].have < 0) {
            add("data",
                fmt::format("data: {} sends {}, which is {}", d(r, i), buf(b),
                            later_or_never(r, i, b)),
                {r}, {i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].have >= group_start) {
            add("data",
                fmt::format("data: {} sends {}, which is only received in the same group at #{}",
                            d(r, i), buf(b), bs[b].have),
                {r, r}, {bs[b].have, i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].freed >= 0) {
            add("buffer",
                fmt::format("buffer: {} sends {} after {} (freed before its last use)", d(r, i),
                            buf(b), d(r, bs[b].freed)),
                {r, r}, {bs[b].freed, i}, key(b).stage, key(b).microbatch);
          }
          break;
        }
        case OpCode::Free: {
          const int32_t b = in.buffer;
          touch(b);
          if (bs[b].have < 0) {
            if (report && !full())
              add("buffer",
                  fmt::format("buffer: {} frees {}, which does not exist on rank {} at that point",
                              d(r, i), buf(b), r),
                  {r}, {i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].freed >= 0) {
            if (report && !full())
              add("buffer",
                  fmt::format("buffer: {} frees {} twice: it was already freed by {}", d(r, i),
                              buf(b), d(r, bs[b].freed)),
                  {r, r}, {bs[b].freed, i}, key(b).stage, key(b).microbatch);
          } else {
            bs[b].freed = i;
            if (is_wgrad(b) && bs[b].acc < 0 && report && !full())
              add("data",
                  fmt::format("data: {} frees weight gradient {} before it is ACCUMULATEd", d(r, i),
                              buf(b)),
                  {r}, {i}, key(b).stage, key(b).microbatch);
          }
          break;
        }
        case OpCode::Accumulate: {
          const int32_t b = in.buffer;
          touch(b);
          if (!report || full()) {
            bs[b].acc = i;
            break;
          }
          if (bs[b].have < 0) {
            add("data",
                fmt::format("data: {} accumulates {}, which is {}", d(r, i), buf(b),
                            later_or_never(r, i, b)),
                {r}, {i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].freed >= 0) {
            add("buffer",
                fmt::format("buffer: {} accumulates {} after {} (freed before its last use)",
                            d(r, i), buf(b), d(r, bs[b].freed)),
                {r, r}, {bs[b].freed, i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].acc >= 0) {
            add("data",
                fmt::format("data: {} accumulates {} a second time (first at #{})", d(r, i), buf(b),
                            bs[b].acc),
                {r, r}, {bs[b].acc, i}, key(b).stage, key(b).microbatch);
          }
          bs[b].acc = i;
          break;
        }
      }
    }
    for (int32_t b : touched) {
      if (!report || full()) break;
      if (bs[b].have >= 0 && bs[b].freed < 0) {
        add("buffer",
            fmt::format("buffer: rank {}: {} (created by {}) is never freed", r, buf(b),
                        d(r, bs[b].have)),
            {r}, {bs[b].have}, key(b).stage, key(b).microbatch);
      }
      if (bs[b].have >= 0 && is_wgrad(b) && bs[b].acc < 0 && bs[b].freed < 0) {
        add("data",
            fmt::format("data: rank {}: weight gradient {} (from {}) is never ACCUMULATEd", r,
                        buf(b), d(r, bs[b].have)),
            {r}, {bs[b].have}, key(b).stage, key(b).microbatch);
      }
    }
    for (int32_t b : touched) bs[b] = BufState{};
  }
  rank_group_begin_[R] = static_cast<int32_t>(groups_.size());
}

}  // namespace baton::verify_detail
