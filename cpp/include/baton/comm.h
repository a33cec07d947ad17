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
#pragma once
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

#include "baton/runtime.h"

namespace baton::runtime {

// Tags of program transfers: [kCommTagBase, kCommTagBase + 2^42), above the
// executor's (step * buffers + buffer) and below the frontend Router's (2^44).
inline constexpr uint64_t kCommTagBase = uint64_t{1} << 42;

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
  uint64_t seq = 0;  // per (peer, channel, direction)
  Clock::time_point posted{}, started{}, completed{};
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

  // Runs one group. `sends` are the SEND operations' tensors in order (the
  // layout of each SEND is its (channel, stage) layout); `outs` the WAIT
  // operations' result tensors in order. Throws ExecutionError (after aborting
  // the transport and recording the failure).
  void run_group(const std::vector<CommOp>& ops, const std::vector<ConstBytes>& sends,
                 const std::vector<MutBytes>& outs);
  // Waits (bounded) for every send posted so far: the end of a step.
  void drain();
  // Records `msg` as the failure (unless one is known) and aborts the transport
  // so every other rank's waits fail at once (e.g. a task of this rank raised).
  // Never throws.
  void abort(const std::string& msg, int origin);

  // A task boundary of the program (phase 0: a task starts, 1: it ended): when
  // recording, its time is kept (the k-th begin/end pair of a step is the
  // rank's k-th task in stream order). Needs no transport.
  void mark(int phase);
  // (phase, time) of the marks recorded since the last call (moved out).
  std::vector<std::pair<int, Clock::time_point>> take_marks();

  // (origin rank, message) of the first failure since attach, if any.
  std::optional<std::pair<int, std::string>> failure() const;
  // Events recorded since the last call (moved out).
  std::vector<CommEvent> take_events();
  int rank() const { return rank_; }
  // Transfers posted since attach (sends, receives).
  std::pair<uint64_t, uint64_t> counts() const;

 private:
  struct Pending {
    RequestPtr req;
    size_t event = SIZE_MAX;  // index into events_, when recording
  };
  uint64_t tag(uint64_t seq, int channel) const;
  const std::vector<size_t>& layout(int channel, int stage) const;
  Layout layout_of(const std::vector<size_t>& bytes) const;
  std::string name(const CommOp& op, uint64_t seq) const;
  void post_recv(const CommOp& op);
  // Records a posted transfer when recording; its index in events_, else SIZE_MAX.
  size_t note_posted(CommOpKind kind, const CommOp& op, uint64_t seq, const Request& r);
  void wait_done(const Pending& p, const std::string& doing);
  [[noreturn]] void fail(const std::string& msg, int origin);
  void reap();

  const int rank_;
  std::chrono::milliseconds timeout_;
  // A program's groups run one at a time (its token orders them); mu_ guards
  // only what other threads read: the failure and the events.
  mutable std::mutex mu_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Tasks> host_;  // host-tensor conversions for byte transports
  std::map<std::pair<int, int>, std::vector<size_t>> layouts_;
  std::map<std::tuple<int, int, bool>, std::vector<std::string>> names_;
  std::map<std::pair<int, int>, uint64_t> send_seq_, recv_seq_;
  std::map<std::pair<int, int>, std::deque<Pending>> posted_;  // FIFO per (peer, channel)
  std::vector<Pending> sends_;
  std::optional<std::pair<int, std::string>> failure_;
  bool record_ = false;
  std::vector<CommEvent> events_;
  std::vector<std::pair<int, Clock::time_point>> marks_;
  uint64_t sent_ = 0, received_ = 0;
};

// Contexts by id, for the FFI handlers (an attribute of the custom call names
// the id). Ids are never reused within a process.
int64_t register_comm(std::shared_ptr<RankComm> comm);
void unregister_comm(int64_t id);
std::shared_ptr<RankComm> find_comm(int64_t id);  // null when unknown

}  // namespace baton::runtime
