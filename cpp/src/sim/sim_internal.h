// Internal (not installed): the simulator's state and its record types, shared
// by sim.cc (the event loop), sim_results.cc (memory peaks, critical path) and
// sim_errors.cc (error messages).
#pragma once
#include <fmt/format.h>

#include <array>
#include <bit>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "baton/error.h"
#include "baton/sim.h"

namespace baton::sim_detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Dense buffer ids as documented in plan.h; id / M indexes the per-(kind,
// stage or skip edge) byte table.
struct Ids {
  const Plan* plan = nullptr;
  int32_t S = 0, M = 0, count_ = 0;
  int32_t count() const { return count_; }
  BufferKey key(int32_t id) const { return plan->buffer_key(id); }
};

// Small fixed-capacity id list (what an action touches).
struct IdList {
  std::array<int32_t, Plan::kMaxIO> v;
  std::array<int32_t, Plan::kMaxIO> ks;  // id / M of each (indexes the byte table)
  int n = 0;
  bool dedupe = false;  // only a fused pair can name a buffer twice
  void add(int32_t x, int32_t M) {
    if (dedupe)
      for (int j = 0; j < n; ++j)
        if (v[j] == x) return;
    ks[n] = x / M;
    v[n++] = x;
  }
  bool contains(int32_t x) const {
    for (int k = 0; k < n; ++k)
      if (v[k] == x) return true;
    return false;
  }
};

inline void task_io(const Ids& ids, const Task& t, IdList& in, IdList& out) {
  int32_t a[Plan::kMaxIO], b[Plan::kMaxIO];
  int na = 0, nb = 0;
  ids.plan->task_io(t, a, na, b, nb);
  for (int k = 0; k < na; ++k) in.add(a[k], ids.M);
  for (int k = 0; k < nb; ++k) out.add(b[k], ids.M);
}

// Where a buffer lives on a rank: a Life record index, or kLocal for a
// buffer produced on the rank and neither sent nor freed yet (most buffers:
// they need no record).
constexpr int32_t kNoLife = -1;
constexpr int32_t kLocal = -2;
// A buffer produced and consumed inside one fused action (the stash of a
// fused F(s,m)+B(s,m)): present on the rank, but no buffer memory (the
// runtime keeps it inside the action's program).
constexpr int32_t kInternal = -3;

// Map from buffer id to its life on one rank: open addressing with linear
// probing and backward-shift deletion. It holds only the rank's live
// buffers, so it stays small and in cache (a dense table over all buffer
// ids would cost a cache miss per first touch).
class LiveMap {
 public:
  LiveMap() { rehash(32); }
  int32_t get(int32_t key) const {
    for (uint32_t i = home(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return vals_[i];
      if (keys_[i] == kEmpty) return kNoLife;
    }
  }
  int32_t* find(int32_t key) {
    for (uint32_t i = home(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }
  // False (and no change) when the key is present.
  bool insert(int32_t key, int32_t val) {
    if (2 * (size_ + 1) > mask_ + 1) rehash(2 * (mask_ + 1));
    uint32_t i = home(key);
    for (; keys_[i] != kEmpty; i = (i + 1) & mask_)
      if (keys_[i] == key) return false;
    keys_[i] = key;
    vals_[i] = val;
    ++size_;
    return true;
  }
  void erase(int32_t key) {
    uint32_t i = home(key);
    for (; keys_[i] != key; i = (i + 1) & mask_)
      if (keys_[i] == kEmpty) return;
    for (uint32_t j = i;;) {
      j = (j + 1) & mask_;
      if (keys_[j] == kEmpty) break;
      const uint32_t k = home(keys_[j]);
      // Entry j may move back to i unless its home lies cyclically in (i, j].
      if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
      keys_[i] = keys_[j];
      vals_[i] = vals_[j];
      i = j;
    }
    keys_[i] = kEmpty;
    --size_;
  }

 private:
  static constexpr int32_t kEmpty = -1;
  uint32_t home(int32_t key) const { return (static_cast<uint32_t>(key) * 2654435769u) >> shift_; }
  void rehash(uint32_t cap) {
    std::vector<int32_t> k(cap, kEmpty), v(cap, 0);
    keys_.swap(k);
    vals_.swap(v);
    mask_ = cap - 1;
    shift_ = 32 - static_cast<uint32_t>(std::countr_zero(cap));
    size_ = 0;
    for (size_t i = 0; i < k.size(); ++i)
      if (k[i] != kEmpty) insert(k[i], v[i]);
  }
  std::vector<int32_t> keys_, vals_;
  uint32_t mask_ = 0, shift_ = 32, size_ = 0;
};

// A buffer's life on one rank. Records are recycled once the buffer is
// released, so only live buffers occupy the table.
struct Life {
  int32_t rank = 0;
  int32_t buffer = 0;
  int32_t transfer = -1;      // received: the transfer that brings it
  int32_t pending_sends = 0;  // sends of it from this rank not yet resolved
  int64_t bytes = 0;
  double ready = 0;         // when it is present (produced or arrived)
  double free_post = kInf;  // FREE posted
  double send_end = -kInf;  // latest completion of a send of it from this rank
  bool activation = false;
  bool freed = false;
  bool ready_known = true;
};

enum class Pred : uint8_t { None, Run, Transfer };
enum class XferPred : uint8_t { SendPost, LinkBusy, RecvPost };

// Simulator-side state of a transfer (the TransferEvent lives in the result).
struct XferState {
  int32_t next_open = -1;  // open transfers of the same buffer to the same rank
  int32_t send_life = -1, recv_life = -1;
  int32_t send_run = -1, recv_run = -1;  // sender's / receiver's last RUN at posting
  int32_t link_prev = -1;                // previous transfer on the same link
  double dur = 0, recv_posted = 0;
  bool has_send = false, has_recv = false, resolved = false, waited = false;
  XferPred start_pred = XferPred::SendPost;
  XferPred end_pred = XferPred::SendPost;
};

struct RunPred {
  Pred kind = Pred::None;
  int32_t index = -1;
};

// A memory event: deltas of the activation and total bytes on a rank.
struct MemEvent {
  double time;
  int64_t act, total;
};

enum class Status : uint8_t { Ready, Blocked, Done };

struct RankState {
  int32_t pc = 0;
  double time = 0;
  int32_t last_run = -1;  // index in result.runs
  int32_t next_run = 0;   // where this rank's next RUN goes in result.runs
  int32_t missing = 0;
  Status status = Status::Ready;
  bool queued = false;
  int64_t act = 0, total = 0;  // live bytes, without the releases that wait for sends
  int32_t ahead = 0;           // early_receives: instructions before this were scanned
};

class Simulator {
 public:
  Simulator(const Plan& plan, const CostModel& costs, SimOptions opts)
      : plan_(plan), costs_(costs), opts_(opts) {
    const Schedule& s = plan.schedule;
    P_ = s.num_ranks;
    ids_.plan = &plan;
    ids_.S = s.num_stages;
    ids_.M = s.num_microbatches;
    ids_.count_ = plan.num_buffer_ids();
    nids_ = ids_.count();
  }

  SimResult run();

 private:
  std::string buf_name(int32_t id) const { return plan_.describe_buffer(id); }
  std::string describe(int rank, int index) const;
  [[noreturn, gnu::cold, gnu::noinline]] void fail(int rank, int index,
                                                   const std::string& why) const {
    throw VerifyError(fmt::format("simulate: {}: {}", describe(rank, index), why));
  }
  // Bytes and kind of a buffer, from a table per (kind, stage).
  struct BufInfo {
    int64_t bytes = 0;
    bool activation = false;
  };
  const BufInfo& info(int32_t id) const { return info_[id / ids_.M]; }
  // Life of buffer `id` on `rank`: a record index, kLocal, or kNoLife.
  int32_t find_life(int32_t rank, int32_t id) const { return live_[rank].get(id); }
  // Records that `id` is live on `rank` (life or kLocal); throws when it
  // already is.
  void claim(int32_t rank, int32_t id, int32_t life, int pc) {
    if (!live_[rank].insert(id, life)) [[unlikely]]
      fail(rank, pc, fmt::format("{} is already live on rank {}", buf_name(id), rank));
  }
  // A record for a buffer arriving by RECV (allocated at `alloc`).
  int32_t new_life(int32_t rank, int32_t id, double alloc, int pc);
  // A record for a local buffer that is being sent.
  int32_t materialize(int32_t rank, int32_t id, double ready);
  // Releases life `l` at `time` (its rank's cursor when `late` is false;
  // otherwise any time, merged into the timeline at the end) and recycles it.
  void release(int32_t l, double time, bool late);
  void mem_event(int32_t rank, double time, int64_t act, int64_t total) {
    RankState& st = ranks_[rank];
    st.act += act;
    st.total += total;
    auto& v = res_.memory[rank];
    if (!v.empty() && v.back().time == time) {
      v.back().activation = st.act;
      v.back().total = st.total;
    } else {
      v.push_back({time, st.act, st.total});
    }
  }
  int32_t open_transfer(int32_t src, int32_t dst, int32_t id, bool want_send);
  void close_transfer(int32_t t);
  void resolve(int32_t t);
  void step(int32_t rank);
  void push(int32_t rank) {
    RankState& st = ranks_[rank];
    if (!st.queued) {
      st.queued = true;
      work_.push_back(rank);
    }
  }
  void check_instr(int rank, int index, const Instr& in) const;
  [[noreturn]] void report_stuck() const;
  void finish_memory();
  void build_critical_path();

  const Plan& plan_;
  const CostModel& costs_;
  SimOptions opts_;
  // early_receives: per rank, per instruction, when a RECV was posted ahead (-1: not).
  std::vector<std::vector<double>> early_post_;
  int32_t P_ = 0;
  Ids ids_;
  int32_t nids_ = 0;
  SimResult res_;
  std::vector<RankState> ranks_;
  std::vector<int32_t> work_;
  std::vector<Life> lives_;
  std::vector<int32_t> free_lives_;
  std::vector<LiveMap> live_;  // per rank: buffer id -> life
  std::vector<XferState> xs_;  // parallel to res_.transfers
  std::vector<LiveMap> open_;  // per receiving rank: buffer id -> transfers missing a side
  std::vector<double> link_free_;
  std::vector<int32_t> link_last_;
  std::vector<RunPred> run_pred_;            // parallel to res_.runs
  std::vector<BufInfo> info_;                // per kind * S + stage
  std::vector<std::vector<MemEvent>> late_;  // per rank: releases that waited for sends
};

}  // namespace baton::sim_detail
