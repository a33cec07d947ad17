// Runtime: executes one rank's program of the rank IR (rank_program.h), the
// instruction stream the compiled engine lowers.
//
//   POST g       posts the group's sends (the buffers' values) and receives
//                to the Transport; never blocks. The receives are handed to
//                the transport at the end of the stretch of POST, FREE and
//                ACCUMULATE instructions the POST is in (before the next WAIT
//                or RUN): none of them waits, so no order a transport sees
//                changes (receives match by tag, in post order), and the
//                FREEs of that stretch release their buffers before the
//                receives are posted, as the simulators count memory at one
//                time. NCCL, which issues a group's sends and receives as
//                one call, gets them with the sends.
//   WAIT t       waits (bounded) until receive t has arrived; its value is
//                then present (Tasks::received).
//   RUN u        calls Tasks::run with the unit's inputs (present); stores
//                the outputs.
//   FREE b       drops b; when a send of b is still in flight the value is
//                released once that send completes (FREE does not block, so
//                a slow send never holds up the next task).
//   ACCUMULATE b calls Tasks::accumulate with b's value.
//   OFFLOAD / FETCH are not interpreted: the executor refuses a program that
//                has them (ConfigError, at construction).
// Transfers are moved by the transport's own threads (the progress engine)
// while tasks run. Every blocking wait has a deadline (ExecutorOptions::
// timeout); when it passes, or a peer fails, the executor aborts the transport
// (which tells every other rank) and throws an ExecutionError naming the rank,
// instruction and buffer (RankIR::describe), and the failed peer if known.
//
// Values are opaque reference-counted handles (ValueBase): in Python a list of
// jax.Arrays, in tests a number. Byte transports (Gloo, NCCL) convert a value
// to host/device tensors (Payload) and back through Tasks::to_payload /
// from_payload, called on transport threads.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "baton/error.h"
#include "baton/plan.h"
#include "baton/rank_program.h"

namespace baton::runtime {

using Clock = std::chrono::steady_clock;

// A pipelined step failed while running (Python: baton.ExecutionError).
class ExecutionError : public Error {
 public:
  explicit ExecutionError(const std::string& what, int origin = -1)
      : Error(what), failed_rank(origin) {}
  int failed_rank = -1;  // the rank that failed first, when known
};

// ---------------------------------------------------------------- tensors

enum class DType : uint8_t {
  F32 = 0,
  F64,
  F16,
  BF16,
  I8,
  I16,
  I32,
  I64,
  U8,
  U16,
  U32,
  U64,
  Bool,
};
const char* dtype_name(DType d);  // "float32", "bfloat16", ...
size_t dtype_size(DType d);
DType dtype_from_name(const std::string& name);  // throws ConfigError

// A dense, C-contiguous tensor in host (or device) memory. `owner` keeps the
// memory alive; `data` points into it.
struct Tensor {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  void* data = nullptr;
  size_t nbytes = 0;
  int device = -1;  // -1: host; >= 0: CUDA device ordinal (NCCL transport)
  std::shared_ptr<void> owner;
};
using Payload = std::vector<Tensor>;

// Dtype and shape of one tensor of a value: what a receiver expects when the
// transport carries no header (NCCL).
struct TensorSpec {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  bool operator==(const TensorSpec&) const = default;
};
using Layout = std::vector<TensorSpec>;

// A 64-byte aligned host allocation of `nbytes` (zero-copy friendly for XLA).
Tensor alloc_host_tensor(DType dtype, std::vector<int64_t> shape);
int64_t num_elements(const std::vector<int64_t>& shape);
// "[float32[4,64,256], int32[4]]".
std::string describe_layout(const Layout& layout);
// Empty when `p` has exactly `layout`'s dtypes and shapes; else what differs.
std::string layout_mismatch(const Payload& p, const Layout& layout);

// Makes glibc's malloc keep freed host memory for reuse instead of handing it
// back to the kernel: XLA:CPU allocates every execution's temporaries and
// outputs afresh, and with glibc's defaults those large blocks are mmap'd and
// unmapped per call, so each call page-faults its whole working set in again
// (measured: ~10k faults and ~10 ms per call of a 40 MB GPT step). The cost:
// the process keeps its peak host memory. False where unsupported (not glibc).
bool retain_host_memory();

// ---------------------------------------------------------------- values

class ValueBase {
 public:
  virtual ~ValueBase() = default;
  // Bytes held, for memory accounting (0 when unknown).
  virtual size_t nbytes() const { return 0; }
};
using Value = std::shared_ptr<ValueBase>;

// A value made of host tensors; what byte transports produce when the Tasks
// do not override from_payload.
class HostValue : public ValueBase {
 public:
  explicit HostValue(Payload p) : tensors(std::move(p)) {}
  size_t nbytes() const override;
  Payload tensors;
};

// What the executor passes to Tasks::run.
struct TaskCall {
  int rank = 0;
  int instr = 0;   // the plan instruction of the RUN (Plan::programs)
  int action = 0;  // index into schedule.rank_actions[rank]
  const Action* act = nullptr;
  const std::vector<int32_t>* input_ids = nullptr;   // Plan::action_inputs
  const std::vector<int32_t>* output_ids = nullptr;  // Plan::action_outputs
  std::vector<Value> inputs;                         // parallel to input_ids
};

// The compiled tasks of one rank (in Python: jitted functions).
class Tasks {
 public:
  virtual ~Tasks() = default;
  // Must return one value per output id (null values are an error).
  virtual std::vector<Value> run(const TaskCall& call) = 0;
  // Adds weight gradient `buffer` into its stage's accumulator.
  virtual void accumulate(int rank, int32_t buffer, const Value& v) = 0;
  // Called in the executor thread when a received value is first used
  // (in-process transport: move it to this rank's devices). Default: as is.
  virtual Value received(int rank, int32_t buffer, Value v);
  // Conversions for byte transports, called on transport threads. Defaults
  // handle HostValue and throw ExecutionError for anything else.
  virtual Payload to_payload(const Value& v);
  virtual Value from_payload(Payload p);
  // The layout of `buffer` as `rank` will receive it, when known (the
  // frontend knows every buffer's avals). Needed by NCCL, which sends no
  // header; Gloo then sends none either. Empty means unknown. The executor
  // asks once per buffer and keeps the answer. Default: empty.
  virtual Layout recv_layout(int rank, int32_t buffer);
};

// ---------------------------------------------------------------- transport

// One posted transfer. Completed by the transport (any thread), waited on by
// the executor. Thread-safe.
class Request {
 public:
  Request(bool send, int to_or_from, uint64_t tg, std::string description)
      : is_send(send),
        peer(to_or_from),
        tag(tg),
        what(std::move(description)),
        posted(Clock::now()) {}
  const bool is_send;
  const int peer;
  const uint64_t tag;
  const std::string what;  // e.g. "act(s0,m1)"
  const Clock::time_point posted;

  void mark_started();
  void complete(Value v = nullptr);
  void fail(std::exception_ptr e);
  // Waits until done or the deadline; true when done (completed or failed).
  bool wait_until(Clock::time_point deadline);
  bool done() const;
  // Rethrows the failure, if any.
  void check() const;
  Value take_value();
  Clock::time_point started_at() const;
  Clock::time_point completed_at() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  Value value_;
  Clock::time_point started_{};
  Clock::time_point completed_{};
};
using RequestPtr = std::shared_ptr<Request>;

struct TransportOptions {
  // Artificial delay added to every transfer (tests of overlap).
  std::chrono::milliseconds delay{0};
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string kind() const = 0;  // "local", "gloo", "nccl"
  // Posts never block. `tasks` converts values for byte transports and must
  // outlive the request. Matching is by (peer, tag). `channel` names an
  // ordered channel (the executor uses the buffer kind: activations and
  // gradients travel on separate channels, see CommModel::Fifo); transports
  // that match by tag (local, gloo) ignore it, NCCL keeps one communicator
  // per channel.
  // `layout`: the tensors the receiver expects (Tasks::recv_layout of the
  // receiving rank), when known. The sender checks the value against it and
  // fails the request, naming both, on a mismatch. With a known layout Gloo
  // sends the tensors alone (no header); both ends must agree on whether the
  // layout is known, which holds when both take it from the same plan.
  virtual RequestPtr isend(int peer, uint64_t tag, Value v, const std::string& what, Tasks* tasks,
                           int channel = 0, const Layout& layout = {}) = 0;
  // `layout`: the expected tensors when known (required by NCCL; with it Gloo
  // posts the tensor receives at once and reads no header).
  virtual RequestPtr irecv(int peer, uint64_t tag, const std::string& what, Tasks* tasks,
                           int channel = 0, const Layout& layout = {}) = 0;
  // Ends a communication group (the executor calls it after the posts of a
  // POST). NCCL issues a group's operations as one ncclGroupStart/End; other
  // transports ignore it.
  virtual void flush() {}
  // Returns once no transfer thread uses `tasks` any more (bounded; after a
  // failure, aborted transfers may still be finishing a conversion). The
  // executor calls it from its destructor.
  virtual void release(Tasks* tasks) { (void)tasks; }
  // Every rank contributes a blob, every rank gets all blobs (start-up
  // handshake). Bounded by `timeout`.
  virtual std::vector<std::string> exchange(const std::string& mine,
                                            std::chrono::milliseconds timeout) = 0;
  // A rank failed (`origin`: the rank where the failure started; -1 means
  // this rank): tell every peer and fail every pending request with an
  // ExecutionError naming `origin`. Idempotent (the first call wins); never
  // throws.
  virtual void abort(const std::string& reason, int origin = -1) = 0;
  // (origin rank, reason) once any rank reported a failure or a peer became
  // unreachable; empty otherwise.
  virtual std::optional<std::pair<int, std::string>> failure() const = 0;
  // Peers this rank has heard nothing from (not even a heartbeat) for longer
  // than the transport's silence limit, the longest silent first. Empty for
  // transports without a heartbeat (local, NCCL) and for a rank whose own
  // heartbeat is off.
  struct Silence {
    int rank = -1;
    double seconds = 0;
  };
  virtual std::vector<Silence> silent_peers() const { return {}; }
};

// What a transfer timeout on a rank that waited for `waited` blames: the
// longest-silent peer when `transport` knows of one (a stopped or cut-off
// process: the peer waited for may itself be waiting for it), else
// `fallback`. `note` is appended to the timeout message ("; rank 3 has been
// silent for 9.8 s ..."; empty when no peer is silent).
struct TimeoutBlame {
  int origin = -1;
  std::string note;
};
TimeoutBlame blame_silence(const Transport* transport, int waited, int fallback);

// In-process transport: N executors (threads) in one process hand value
// handles to each other through a shared hub. Sends complete at once (after
// `delay`); a receive completes when its send is posted (plus `delay`).
class LocalHub : public std::enable_shared_from_this<LocalHub> {
 public:
  static std::shared_ptr<LocalHub> create(int world_size, TransportOptions opts = {});
  std::unique_ptr<Transport> transport(int rank);
  int world_size() const { return world_; }

  // internals used by the local transport
  struct State;
  std::shared_ptr<State> state() const { return state_; }

 private:
  int world_ = 0;
  std::shared_ptr<State> state_;
};

// Gloo over TCP. `store` is the rendezvous store (HashStore between threads,
// FileStore on one host, or any Store, e.g. backed by jax.distributed's key-
// value store). Connects the full mesh in the constructor (bounded by
// `connect_timeout`). Tags map to Gloo slots; each transfer sends a small
// header (count, dtypes, shapes) then one message per tensor; received host
// tensors are 64-byte aligned. A control channel carries failure reports
// and the shutdown handshake; a lost connection marks the peer failed.
struct GlooOptions : TransportOptions {
  std::string hostname = "127.0.0.1";
  // Bounds this rank's whole start-up (rendezvous and connect; every rank must
  // start within it); on expiry an ExecutionError names the missing or
  // unreachable rank(s). Transfers after start-up are not bounded by it.
  std::chrono::milliseconds connect_timeout{30000};
  std::string prefix = "baton";  // store key prefix
  // Every `heartbeat` each rank sends every peer a small message on the
  // control slot (from a thread of its own, so a rank busy in a task or a
  // compile still beats). A peer unheard for 3 heartbeats is silent
  // (Transport::silent_peers), and a transfer timeout names it. 0: off.
  std::chrono::milliseconds heartbeat{1000};
};
// Minimal rendezvous store interface (maps onto gloo::rendezvous::Store).
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists or the timeout passes (then throws).
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};
std::shared_ptr<Store> make_hash_store();                        // in-process
std::shared_ptr<Store> make_file_store(const std::string& dir);  // one host
std::shared_ptr<Store> make_callback_store(
    std::function<void(const std::string&, const std::string&)> set,
    std::function<std::string(const std::string&, std::chrono::milliseconds)> get);
std::unique_ptr<Transport> make_gloo_transport(int rank, int world_size,
                                               std::shared_ptr<Store> store, GlooOptions opts = {});

// NCCL point-to-point (compiled only when CUDA and nccl.h are found; see
// nccl_available()). Values must convert to device tensors (Tensor::device
// >= 0). The unique id travels through `store`. Throws ConfigError when
// Baton was built without NCCL.
bool nccl_available();
// `channels` communicators are created up front, in the same order on every
// rank (channel c carries buffer kind c: 0 act, 1 grad).
std::unique_ptr<Transport> make_nccl_transport(int rank, int world_size, int device,
                                               std::shared_ptr<Store> store,
                                               TransportOptions opts = {}, int channels = 2);

// ---------------------------------------------------------------- executor

struct ExecutorOptions {
  // Longest time one instruction may wait for a transfer.
  std::chrono::milliseconds timeout{60000};
  bool record_events = false;
};

// One instruction of the rank's Plan stream (plan.h), as traces and memory
// replays read them: the executor runs the rank IR and records each of its
// RUNs, transfers, FREEs and ACCUMULATEs under the plan instruction it comes
// from (a POST records one SEND or RECV per transfer; a WAIT is part of the
// RUN after it).
struct Event {
  int32_t instr = -1;  // the plan instruction's index
  OpCode op = OpCode::Run;
  int32_t buffer = -1;  // SEND/RECV/FREE/ACCUMULATE: the plan buffer id
  int32_t peer = -1;
  // RUN: posted = reached (the first WAIT just before it), started = inputs
  // ready, completed = returned. SEND/RECV: posted by the POST;
  // started/completed by the transport.
  Clock::time_point posted{}, started{}, completed{};
};

struct ExecStats {
  int64_t peak_live_buffers = 0;
  int64_t peak_live_bytes = 0;
  int64_t instructions = 0;  // rank IR instructions run
  double wait_seconds = 0;   // time blocked on transfers
};

class Executor {
 public:
  // Runs ir.programs[rank]. `ir`, `transport` and `tasks` must outlive the
  // executor. Throws ConfigError for a rank or transport that does not fit
  // and for a program with OFFLOAD / FETCH instructions (not interpreted).
  Executor(const RankIR& ir, int rank, Transport& transport, Tasks& tasks,
           ExecutorOptions opts = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  // Runs this rank's program once (one training step). Throws ExecutionError.
  void run();
  // Compares plan fingerprint, Baton version, schedule and world size with
  // every rank; throws ExecutionError saying what differs (on every rank).
  void handshake(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
  // The last step's events, ordered by plan instruction; empty unless
  // ExecutorOptions::record_events.
  const std::vector<Event>& events() const { return events_; }
  const ExecStats& stats() const { return stats_; }
  int rank() const { return rank_; }
  int64_t steps_done() const { return step_; }

 private:
  struct Slot {  // one per RankProgram::buffers entry
    Value value;
    RequestPtr recv;                // posted, not yet waited on
    std::vector<RequestPtr> sends;  // posted sends not yet released by a FREE
    bool present = false;
  };
  void exec(int index, const RankInstr& in);
  void post(int index, const TransferGroup& g);
  void post_recv(int index, int32_t transfer);
  void post_queued_recvs();
  // The receiver's layout of local buffer `b` (Tasks::recv_layout of
  // `receiver`), asked once per buffer; empty for the in-process transport,
  // which moves handles.
  const Layout& layout_of(int index, int32_t b, int receiver);
  Value present(int index, int32_t b, const char* doing);
  void wait(int index, const RequestPtr& r, const char* doing);
  [[noreturn]] void fail(int index, const std::string& msg, int failed_rank = -1);
  std::string where(int index) const;
  std::string name(int32_t b) const;  // "act(s0,m1)" of local buffer b
  void add_live(const Value& v);
  void drop_live(const Value& v);
  uint64_t tag(int32_t b) const;
  void record(int32_t plan_instr, Clock::time_point posted, Clock::time_point started);
  void reap(bool wait_all, int index);

  const RankIR& ir_;
  const Plan& plan_;
  const RankProgram& prog_;
  int rank_;
  Transport& transport_;
  Tasks& tasks_;
  ExecutorOptions opts_;
  std::vector<Slot> slots_;
  std::vector<std::vector<int32_t>> unit_in_, unit_out_;  // plan buffer ids per unit
  // The plan instruction of each rank instruction (RUN, FREE, ACCUMULATE;
  // -1 for the others) and of each transfer: what events are recorded under.
  std::vector<int32_t> instr_plan_, transfer_plan_;
  std::vector<Event> events_;
  std::vector<std::pair<size_t, RequestPtr>> pending_events_;  // SEND/RECV events
  std::vector<std::optional<Layout>> layouts_;  // per local buffer (empty: local); layout_of
  // FREEd buffers whose send is still in flight: released when it completes.
  std::vector<std::pair<RequestPtr, Value>> deferred_;
  ExecStats stats_;
  int64_t live_buffers_ = 0, live_bytes_ = 0;
  int64_t step_ = 0;
  Clock::time_point reached_{};  // when the next RUN was reached (its first WAIT)
  // Receives of POSTs not yet handed to the transport: (POST index, transfer).
  // See the top of this file; off for NCCL.
  bool defer_recvs_ = true;
  std::vector<std::pair<int, int32_t>> recv_queue_;
};

// The string compared by the handshake (plan fingerprint, version, schedule).
std::string handshake_blob(const Plan& plan, int world_size);
const char* runtime_version();

}  // namespace baton::runtime
