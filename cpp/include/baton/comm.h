// Transfers of a compiled rank program: what the XLA FFI handlers do.
//
// A rank's step is one XLA program (the Python layer lowers the plan's
// instruction stream into it). Each stretch of transfers between two tasks is
// one custom call, a *group* of operations run in order:
//
//   SEND peer,chan   posts a send of the call's next input buffers (copied
//                    into a transport-owned host tensor, so XLA may reuse its
//                    buffer as soon as the call returns);
//   POST peer,chan   posts a receive (the transport receives into a host tensor
//                    while the program goes on computing);
//   WAIT peer,chan   waits (bounded) for the oldest posted, not yet waited
//                    receive from `peer` on `chan` and copies it into the
//                    call's next result buffers.
//
// Matching needs no buffer ids: the verifier's FIFO model proves that the k-th
// send a->b on channel c (one channel per buffer kind) pairs with the k-th
// receive at b from a on c, so both ends number their transfers per (peer,
// channel) and use the number as the tag. A program therefore carries only
// static attributes (peer, channel, stage), also inside loops (lax.scan), and
// reads no runtime value to find its tags.
//
// Failures: any error (a timeout, a peer that failed, a size mismatch) aborts
// the transport, so every other rank's waiting call fails at once, and is kept
// as the context's failure (message and origin rank) for the Python layer to
// raise as an ExecutionError.
//
// Shards (a rank on several devices). A rank's program may run SPMD over the
// rank's devices (jax.shard_map): XLA then calls each handler once per device,
// concurrently (XLA:CPU runs each device's instance of the program on its own
// thread), each call with that device's local shard. XLA FFI tells a handler
// its device (ffi::Ctx<ffi::DeviceOrdinal>; on CPU the ordinal is the jax
// device's id, checked empirically with jax 0.12: a shard_map over devices
// [3, 2, 1, 0] gave ordinals 3, 2, 1, 0, one per instance, all four instances
// inside the handler at once). set_shards(ordinals) maps ordinal ordinals[i] to
// shard i. Device i of rank a exchanges with device i of rank b: every shard
// has its own counters, posted-receive FIFOs and pending sends, and the shard
// is part of the tag (see comm_tag), so shard i only ever matches shard i. A
// shard's own calls are sequential (its instance's token orders them); shards
// call concurrently. With no set_shards (or an empty list) there is one shard
// and every ordinal maps to it: the one-device rank.
//
// Thread safety of the transports (the shards call isend/irecv/flush from their
// own threads at once, and wait on their own requests): LocalHub's transport
// keeps all its state under the hub's mutex, and Gloo's under its own mutexes
// (the transfer list, the worker threads; the Gloo tcp context and pairs lock
// themselves and are already used from several threads: the posting thread,
// the wait threads, the control listeners); Requests lock themselves. Both are
// therefore called without further locking. Any other transport (NCCL's groups
// are per thread of issue) gets its isend/irecv/flush calls serialized by
// RankComm (post_mu_, never held while waiting).
//
// Failures with shards: a failure on any shard aborts the transport and is
// recorded once (the first wins); the other shards' pending waits fail at once
// and their later calls fail immediately.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "baton/host_slots.h"
#include "baton/runtime.h"
#include "baton/slots.h"

namespace baton::runtime {

// Tags of program transfers: [kCommTagBase, kCommTagBase + 2^42), above the
// executor's (step * buffers + buffer) and below the frontend Router's (2^44).
inline constexpr uint64_t kCommTagBase = uint64_t{1} << 42;
inline constexpr int kCommChannels = 64;       // channels 0..63 (Plan::channel)
inline constexpr int kCommShards = kMaxSlots;  // shards 0..255 (slots.h)
// The tag of the seq-th transfer (per peer, channel, shard and direction):
// kCommTagBase + ((seq mod 2^28) * 64 + channel) * 256 + shard. Distinct for
// distinct (seq mod 2^28, channel, shard); seq wraps (transfers in flight are
// never 2^28 apart). Throws ExecutionError for a channel or shard out of range.
uint64_t comm_tag(uint64_t seq, int channel, int shard);

// A channel's name in messages: 0 "act", 1 "grad", any other "buffer".
inline const char* comm_channel_name(int channel) {
  switch (channel) {
    case 0:
      return "act";
    case 1:
      return "grad";
    default:
      return "buffer";
  }
}

// A duration in seconds, for messages.
inline double comm_seconds(std::chrono::milliseconds t) {
  return static_cast<double>(t.count()) / 1000.0;
}

// Bytes of each tensor of a (channel, stage) buffer (set_layout), by (channel, stage).
using CommLayouts = std::map<std::pair<int, int>, std::vector<size_t>>;
// The (channel, stage) entry of `layouts`; ExecutionError of `rank` when there is none.
const std::vector<size_t>& comm_layout(const CommLayouts& layouts, int rank, int channel,
                                       int stage);

enum class CommOpKind : int32_t { Send = 0, Post = 1, Wait = 2 };

struct CommOp {
  CommOpKind kind = CommOpKind::Send;
  int peer = 0;
  int channel = 0;  // buffer kind (0 act, 1 grad, ...): one FIFO channel each
  int stage = 0;    // the buffer's stage (names and layouts)
};

// A byte range of an XLA buffer.
struct ConstBytes {
  const void* data = nullptr;
  size_t size = 0;
};
struct MutBytes {
  void* data = nullptr;
  size_t size = 0;
};

// One transfer as recorded for traces (times on Clock).
struct CommEvent {
  CommOpKind kind = CommOpKind::Send;
  int peer = 0, channel = 0, stage = 0;
  uint64_t seq = 0;  // per (peer, channel, direction, shard)
  Clock::time_point posted{}, started{}, completed{};
  int shard = 0;  // the shard (device of the rank) that made the transfer
};

class RankComm {
 public:
  RankComm(int rank, std::chrono::milliseconds timeout);
  ~RankComm();
  RankComm(const RankComm&) = delete;
  RankComm& operator=(const RankComm&) = delete;

  // Starts using `transport` (one step or many): counters, pending transfers
  // and the failure are reset. The transport must be this rank's.
  void attach(std::shared_ptr<Transport> transport);
  // Stops using it; waits for nothing (pending transfers are dropped).
  void detach();
  bool attached() const;
  void set_timeout(std::chrono::milliseconds timeout);
  // The bytes of each tensor of a (channel, stage) buffer as this rank receives
  // it; required before a POST or WAIT of it.
  void set_layout(int channel, int stage, std::vector<size_t> bytes);
  // Names of the transfers of one step with `peer` on `channel` in order
  // (sends when `send`, else receives), e.g. "grad(s1,m0)": error messages then
  // name the buffer (the k-th transfer of a step is names[k % names.size()]).
  void set_names(int peer, int channel, bool send, std::vector<std::string> names);
  // Turns event recording on or off (the same program runs either way).
  void record(bool on);
  // The rank's devices: the call of device ordinal ordinals[i] is shard i
  // (distinct, >= 0, at most kCommShards). Empty: one shard, any ordinal.
  // Resets every shard's counters and pending transfers (as attach does); call
  // it while no program runs.
  void set_shards(std::vector<int> ordinals);
  const std::vector<int>& shards() const { return slots_.ordinals(); }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  // The shard of a call from device `ordinal` (0 when no shards are set).
  // Throws ExecutionError when the ordinal is not one of the rank's devices.
  int shard_of(int ordinal) const;

  // A program that several ranks of this process share (one SPMD program over
  // their devices, lowered for the first of them with this context's id;
  // program.py SharedProgram): the handler call of device `ordinal` runs on
  // `member`'s context. route() gives it (null: this context). Set while no
  // program runs.
  void set_route(int ordinal, std::shared_ptr<RankComm> member);
  std::shared_ptr<RankComm> route(int ordinal) const;
  // A shared program's operations name the (peer, channel, stage) of the rank
  // it was lowered for; this context runs an operation of `from[i]` as one of
  // `to[i]` (equal lengths; an operation not in `from` is an internal error).
  // Empty (the default): operations run as they are. Set while no program runs.
  void set_alias(std::vector<std::array<int, 3>> from, std::vector<std::array<int, 3>> to);

  // Runs one group of `shard` (see shard_of). `sends` are the SEND operations'
  // tensors in order (the layout of each SEND is its (channel, stage) layout);
  // `outs` the WAIT operations' result tensors in order. Throws ExecutionError
  // (after aborting the transport and recording the failure).
  void run_group(const std::vector<CommOp>& ops, const std::vector<ConstBytes>& sends,
                 const std::vector<MutBytes>& outs, int shard = 0);
  // Waits (bounded) for every send `shard` posted so far: the end of a step.
  void drain(int shard = 0);
  // Records `msg` as the failure (unless one is known) and aborts the transport
  // so every other rank's waits fail at once (e.g. a task of this rank raised).
  // Never throws.
  void abort(const std::string& msg, int origin);

  // A task boundary of the program (phase 0: a task starts, 1: it ended): when
  // recording, its time is kept (the k-th begin/end pair of a step is the
  // rank's k-th task in stream order). Needs no transport. Only shard 0's
  // marks are kept (every shard has the same task boundaries).
  void mark(int phase, int shard = 0);
  // (phase, time) of the marks recorded since the last call (moved out).
  std::vector<std::pair<int, Clock::time_point>> take_marks();

  // (origin rank, message) of the first failure since attach, if any.
  std::optional<std::pair<int, std::string>> failure() const;
  // Events recorded since the last call (moved out).
  std::vector<CommEvent> take_events();
  int rank() const { return rank_; }
  // Transfers posted since attach (sends, receives), all shards together.
  std::pair<uint64_t, uint64_t> counts() const;
  // The host memory of the program's offloaded buffers (OFFLOAD / FETCH; host_slots.h).
  HostSlots& host_slots() { return host_slots_; }

 private:
  struct Pending {
    RequestPtr req;
    size_t event = SIZE_MAX;  // event number (events_base_ + index in events_), when recording
  };
  // What one shard's calls use; only that shard's thread touches it while a
  // program runs (attach, detach and set_shards run while none does).
  struct Shard {
    std::map<std::pair<int, int>, uint64_t> send_seq, recv_seq;
    std::map<std::pair<int, int>, std::deque<Pending>> posted;  // FIFO per (peer, channel)
    std::vector<Pending> sends;
  };
  Shard& shard_state(int shard);
  const std::vector<size_t>& layout(int channel, int stage) const;
  Layout layout_of(const std::vector<size_t>& bytes) const;
  std::string name(const CommOp& op, uint64_t seq, int shard) const;
  void post_recv(Shard& sh, const CommOp& op, int shard);
  // Transport calls that post (serialized by post_mu_ unless the transport is
  // known to be thread safe; see the header comment).
  RequestPtr t_isend(int peer, uint64_t tag, Value v, const std::string& what, int channel,
                     const Layout& layout);
  RequestPtr t_irecv(int peer, uint64_t tag, const std::string& what, int channel,
                     const Layout& layout);
  void t_flush();
  // Records a posted transfer when recording; its event number, else SIZE_MAX.
  size_t note_posted(CommOpKind kind, const CommOp& op, uint64_t seq, int shard, const Request& r);
  void wait_done(const Pending& p, const std::string& doing);
  [[noreturn]] void fail(const std::string& msg, int origin);
  void reap(Shard& sh);
  void reset_shards();

  const int rank_;
  std::chrono::milliseconds timeout_;
  // A shard's groups run one at a time (its token orders them); mu_ guards
  // only what several threads touch: the failure, the events and the marks.
  mutable std::mutex mu_;
  std::mutex post_mu_;         // serializes posts on transports not known thread safe
  bool serial_posts_ = false;  // set by attach
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Tasks> host_;  // host-tensor conversions for byte transports
  CommLayouts layouts_;
  std::map<std::tuple<int, int, bool>, std::vector<std::string>> names_;
  DeviceSlots slots_;            // set_shards (slots.h); empty: one shard
  SlotRoutes<RankComm> routes_;  // set_route (slots.h)
  std::map<std::array<int, 3>, std::array<int, 3>> alias_;  // set_alias
  std::vector<std::unique_ptr<Shard>> shards_;              // at least one
  HostSlots host_slots_;
  std::optional<std::pair<int, std::string>> failure_;
  bool record_ = false;
  std::vector<CommEvent> events_;
  size_t events_base_ = 0;  // events taken so far (event numbers stay valid across take_events)
  std::vector<std::pair<int, Clock::time_point>> marks_;
  std::atomic<uint64_t> sent_{0}, received_{0};
};

// Contexts by id, for the FFI handlers (an attribute of the custom call names
// the id). Ids are never reused within a process.
int64_t register_comm(std::shared_ptr<RankComm> comm);
void unregister_comm(int64_t id);
std::shared_ptr<RankComm> find_comm(int64_t id);  // null when unknown

// A process-wide id -> context registry (register_comm, register_nccl_comm):
// ids count up from `first` and are never reused; thread-safe.
template <class T>
class CommRegistry {
 public:
  explicit CommRegistry(int64_t first) : next_(first) {}
  int64_t add(std::shared_ptr<T> comm) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_++;
    map_[id] = std::move(comm);
    return id;
  }
  void remove(int64_t id) {
    std::shared_ptr<T> gone;  // destroyed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(id);
    if (it == map_.end()) return;
    gone = std::move(it->second);
    map_.erase(it);
  }
  std::shared_ptr<T> find(int64_t id) const {  // null when unknown
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<int64_t, std::shared_ptr<T>> map_;
  int64_t next_;
};

}  // namespace baton::runtime
