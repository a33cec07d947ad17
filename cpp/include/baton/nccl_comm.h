// Transfers of a compiled rank program on CUDA: the GPU counterpart of
// RankComm (comm.h), called by the CUDA XLA FFI handlers (baton._core.ffi
// handlers_cuda) from XLA's thread with XLA's compute stream. Same operations,
// same matching: SEND / POST / WAIT per (peer, channel), FIFO, the k-th send
// a->b on a channel pairs with the k-th receive at b from a on it.
//
// Staging. XLA may move or copy any value inside a program (scan carries), so
// NCCL never touches an XLA buffer after the call returns:
//   SEND  the input is copied (cudaMemcpyAsync, device to device, on the compute
//         stream) into a staging slot; the link's send stream waits for that copy
//         (an event) and ncclSend's the slot; the slot goes back to the pool once
//         the send's completion event fired. The compute stream never waits for
//         a send.
//   POST  a slot is taken and ncclRecv'd into on the link's receive stream (a
//         slot is only reused after every GPU use of it completed, so the
//         receive stream needs no wait on the compute stream).
//   WAIT  the compute stream waits (cudaStreamWaitEvent) for the oldest posted
//         receive of (peer, channel), then copies slot -> XLA result; the slot
//         goes back once an event recorded after that copy fired.
// A buffer's tensors are packed into one slot (offsets aligned to 256 bytes):
// one ncclSend/ncclRecv per transfer.
//
// Memory. Slots come from a pool keyed by byte size (SlotPool). reserve()
// allocates, before the first step, the slots of the transfers in flight at
// once and the CUDA events they use: a transfer is in flight from its POST
// (a send's or a receive's) to its WAIT (a receive) or the FREE that waits for
// its completion (a send), in the rank IR's instruction order; per direction
// and packed size, the most in flight at once (staging::reservation), not one
// slot per transfer of the step. So no cudaMalloc and no cudaEventCreate runs
// while receives are posted (both can synchronize the device implicitly and
// would serialize the NCCL streams with compute). After reserve() the pool is
// capped: a transfer that finds no free slot of its size waits (bounded by the
// timeout) for one of its size to come free (the host may be ahead of the
// GPU), and fails naming the rank, the direction and the bytes when none
// does, or at once when no slot of its size was reserved. reserved_bytes()
// reports what was reserved. This is memory outside XLA's allocator, a fixed
// pool, not zero; it is freed when the context is destroyed.
//
// Device slots. A rank of several GPUs has one NcclComm per device slot (slot j
// of every rank shares communicators with slot j of the others: shard to shard,
// as the Gloo slot contexts do across processes); each has its own device,
// streams, staging pool and events, so XLA's concurrent per-device handler
// calls (shard_map) never share state. The handlers bind the calling device's
// ordinal and route it (route(), slots.h's SlotRoutes, the same code as the CPU
// contexts) to its slot's context; set_route is given on the context whose id
// the program carries (the lead), which forwards the settings (layouts, names,
// timeout, recording, reserve) to its routed slots and reports their failures.
// In one process per GPU, each process has the one slot it holds, no routes.
//
// Communicators. One 2-rank NCCL communicator per (src -> dst, channel), rank 0
// the sender: the only user at src is that link's send stream, at dst its
// receive stream, so no communicator is used from two streams and FIFO order
// per (peer, channel) is NCCL's order on one communicator and stream. All are
// created at construction from the links the plan uses (both ends list a link),
// unique ids travel through the store, all ncclCommInitRankConfig calls run in
// one ncclGroupStart/End in canonical order (canonical_links), and then one
// 1-byte send/receive per communicator, also grouped, makes NCCL connect the
// peers there, not at the first transfer of a step. The communicators are
// non-blocking (blocking = 0): no NCCL call waits for a peer on the host; setup
// polls ncclCommGetAsyncError until every communicator is ready, under the
// setup deadline (max(timeout, 60 s)); a peer that never comes is an
// ExecutionError naming this rank, the link and the peer, after ncclCommAbort
// of every communicator (no lock is held while polling, so abort always runs).
//
// Host blocking and timeouts. The XLA thread never waits for data except in
// drain() (end of a step: polls the sends' events up to the timeout, noticing
// failures). A WAIT returns once the compute stream is told to wait; a
// watchdog thread bounds that: when the compute stream has reached a WAIT (an
// event recorded just before it completed) and the receive has not completed
// within the timeout, the watchdog aborts every communicator (ncclCommAbort
// ends the pending NCCL kernels, so the GPU does not hang) and records the
// failure; the next baton call of the program (at the latest the step's
// drain) then fails. The watchdog also polls ncclCommGetAsyncError and the
// store's abort key (set by any rank that fails), so one rank's failure aborts
// all.
//
// Failures. Any CUDA/NCCL error, a timeout or abort(): every communicator is
// aborted exactly once (AbortOnce), the first failure (message, origin rank)
// is kept and written to the store. A failed context stays failed; make a new
// one for the next run.
//
// Recording (record(true)): transfers and task marks get CUDA events (timing
// enabled); take_events/take_marks convert them to host steady-clock times
// through an anchor event (recorded and synchronized at record(true)), using
// cudaEventElapsedTime. An event not yet complete when taken reads as 0.
// `posted` is the host time of the enqueue.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "baton/comm.h"
#include "baton/runtime.h"
#include "baton/slots.h"

namespace baton::runtime {

// One direction of a (peer, channel) link of this rank, as the plan uses it.
struct NcclLink {
  int peer = 0;
  int channel = 0;
  bool send = false;  // this rank sends to peer (else receives from it)
};

// Host-side logic of NcclComm, kept free of CUDA so it is tested without a GPU.
namespace staging {

// A link as both of its ends name it.
struct LinkKey {
  int src = 0, dst = 0, channel = 0;
  auto operator<=>(const LinkKey&) const = default;
};

// The links of `rank` as LinkKeys, sorted and without duplicates: the same
// relative order on every rank (a subsequence of one global order). A link to
// the rank itself (a self link: its send and receive directions are one key)
// is a 1-rank communicator. Throws ConfigError for a peer out of range or a
// negative channel.
std::vector<LinkKey> canonical_links(int rank, int world, const std::vector<NcclLink>& links);

// The arguments of an NcclComm, checked before anything touches CUDA (in every
// build): a store is required, 0 <= rank < world, every link's peer in range and
// its channel not negative (canonical_links). A self link (peer == rank) is valid.
// Throws ConfigError naming the argument.
void check_arguments(int rank, int world, bool has_store, const std::vector<NcclLink>& links);

// Offsets of tensors of `bytes` packed into one slot, each aligned to `align`;
// the last element is the total size.
std::vector<size_t> packed_offsets(const std::vector<size_t>& bytes, size_t align = 256);

// Staging buffers by byte size. A buffer in use is retired with a fence (an
// event); it becomes free again once ready(fence) says the fence completed
// (then release(fence) gives the fence back). Not thread-safe (one caller).
class SlotPool {
 public:
  using Alloc = std::function<void*(size_t)>;
  using Free = std::function<void(void*)>;
  using Ready = std::function<bool(void*)>;
  using Release = std::function<void(void*)>;
  SlotPool(Alloc alloc, Free free, Ready ready, Release release);
  ~SlotPool();  // frees every buffer (free or retired: call only once the GPU is idle)
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // A buffer of `bytes` (null for 0): a free one, after reclaiming retired ones,
  // else a new allocation; null when capped (cap()) and none of the size is free.
  void* take(size_t bytes);
  // take() for a capped pool: while none of `bytes` is free and some of that
  // size exist (retired or taken), calls `poll` (which may hand buffers back:
  // retire) and reclaims, sleeping a little between tries, until one is free
  // or `deadline` passed: then null. Null at once when the pool holds no
  // buffer of that size (none will come free). Uncapped: take().
  void* take_within(size_t bytes, const std::function<void()>& poll,
                    std::chrono::steady_clock::time_point deadline);
  // Capped: take() allocates nothing more (reserve() still does).
  void cap(bool on) { capped_ = on; }
  bool capped() const { return capped_; }
  // Buffers of `bytes` that exist (free, retired or taken).
  size_t count(size_t bytes) const;
  // Allocates free buffers of `bytes` until `n` of that size exist (free,
  // retired or taken); how many it allocated.
  size_t reserve(size_t bytes, size_t n);
  // `buf` (from take(bytes)) is free once `fence` completed. A null fence frees it now.
  void retire(void* buf, size_t bytes, void* fence);
  // Moves retired buffers whose fence completed to the free lists; how many.
  size_t reclaim();

  size_t allocations() const { return allocations_; }  // buffers ever allocated
  size_t free_count() const;
  size_t retired_count() const { return retired_.size(); }

 private:
  struct Retired {
    void* buf;
    size_t bytes;
    void* fence;
  };
  Alloc alloc_;
  Free free_;
  Ready ready_;
  Release release_;
  std::map<size_t, std::vector<void*>> free_lists_;
  std::map<size_t, size_t> allocated_;  // buffers of each size ever allocated
  std::deque<Retired> retired_;
  size_t allocations_ = 0;
  bool capped_ = false;
};

// One kind of transfer of a rank's step: `count` transfers of the (channel,
// stage) buffer, sends when `send`, else receives.
struct TransferCount {
  int channel = 0;
  int stage = 0;
  bool send = false;
  int count = 0;
};

// One transfer of a rank's step and where it is in flight in the rank IR's
// instruction order: from `from` (its POST) to `to` (a receive's WAIT, a
// send's FREE that waits for its completion), both included; to < 0: to the
// end of the step.
struct InFlight {
  int channel = 0;
  int stage = 0;
  bool send = false;
  int from = 0;
  int to = -1;
};

// What to allocate before the first step: staging slots by packed byte size
// and CUDA events (a send holds two until reaped, a receive three: posted,
// reached, copied). Per direction and packed size, the most transfers in
// flight at once; the pool is shared by size, so a size's slots are its sends'
// maximum plus its receives'. `send_bytes` / `recv_bytes`: the bytes of the
// slots reserved for each direction (the sum over sizes of size times the most
// in flight at once; with one size per direction, the most bytes in flight at
// once). `layouts` give each (channel, stage)'s tensor sizes; ExecutionError
// of `rank` when one is missing, ConfigError for an interval that ends before
// it starts.
struct Reservation {
  std::map<size_t, size_t> slots;  // packed bytes -> count (0-byte transfers need none)
  size_t events = 0;
  std::map<size_t, size_t> send_slots;  // of `slots`, those for sends
  size_t send_bytes = 0;
  size_t recv_bytes = 0;
};
Reservation reservation(const CommLayouts& layouts, int rank,
                        const std::vector<InFlight>& transfers);
// Every transfer counted in flight at once: `count` transfers of each kind
// (one step's worth; tests and callers that know no instruction order).
Reservation reservation(const CommLayouts& layouts, int rank,
                        const std::vector<TransferCount>& transfers);

// Two reservations of one context (reserve() called for each program that
// shares it): per size the larger slot counts (of each direction), the
// larger event count, bytes recomputed from the merged slots.
Reservation merged(const Reservation& a, const Reservation& b);

// "512 MiB (536870912 bytes)" style.
std::string bytes_text(size_t bytes);
// The error when the `slot_bytes` slots of `r` cannot be allocated: names the
// rank, the direction(s) they are for, the bytes and `why` (the allocator's error).
std::string reserve_failure(int rank, size_t slot_bytes, const Reservation& r,
                            const std::string& why);
// The error when a transfer needs staging beyond the reservation: `what`
// names the transfer (buffer, peer), `reserved` the slots of its size.
std::string beyond_reservation(int rank, bool send, size_t bytes, const std::string& what,
                               size_t reserved, const Reservation& r, double waited_s);

// Per-(peer, channel) FIFO of posted receives, with the per-direction
// sequence numbers (the k-th send pairs with the k-th receive).
template <class T>
class LinkFifo {
 public:
  uint64_t next_send(int peer, int channel) { return send_seq_[{peer, channel}]++; }
  uint64_t next_recv(int peer, int channel) { return recv_seq_[{peer, channel}]++; }
  void push(int peer, int channel, T v) { q_[{peer, channel}].push_back(std::move(v)); }
  bool empty(int peer, int channel) const {
    auto it = q_.find({peer, channel});
    return it == q_.end() || it->second.empty();
  }
  // The oldest / newest entry (references stay valid until that entry is popped).
  T& front(int peer, int channel) { return q_.at({peer, channel}).front(); }
  T& back(int peer, int channel) { return q_.at({peer, channel}).back(); }
  T pop(int peer, int channel) {  // the oldest; the queue must not be empty
    auto& q = q_.at({peer, channel});
    T v = std::move(q.front());
    q.pop_front();
    return v;
  }
  size_t pending() const {
    size_t n = 0;
    for (const auto& [k, q] : q_) n += q.size();
    return n;
  }

 private:
  std::map<std::pair<int, int>, uint64_t> send_seq_, recv_seq_;
  std::map<std::pair<int, int>, std::deque<T>> q_;
};

// Runs every job on a thread of its own and joins them all (a job's exception is
// dropped): close_all_nccl_comms closes contexts at once, not one after another.
void run_concurrently(const std::vector<std::function<void()>>& jobs);

// true for the first caller only (thread-safe): guards ncclCommAbort.
class AbortOnce {
 public:
  bool first() { return !done_.exchange(true); }
  // first() under `mu`: after whatever holds `mu` (an NCCL call in flight) let go
  // of it, and with `mu` released again on return, so the abort that follows runs
  // without a lock other threads need.
  bool first_under(std::mutex& mu) {
    std::lock_guard<std::mutex> lock(mu);
    return first();
  }
  bool done() const { return done_.load(); }

 private:
  std::atomic<bool> done_{false};
};

}  // namespace staging

class NcclComm {
 public:
  // Creates the communicators of `links` (every rank of the program constructs
  // its NcclComm with its own links at the same time). `device` is the CUDA
  // ordinal XLA runs this rank on. `prefix` namespaces the store keys (unique
  // per construction when a store is reused). `setup_timeout` bounds the
  // setup (NCCL ids, communicator init, connecting); 0: max(timeout, 60 s).
  // Throws ConfigError when there is no CUDA device, NCCL cannot be loaded, or
  // Baton was built without CUDA; ExecutionError naming the rank, the link and
  // the peer when setup does not finish in time (communicators aborted).
  NcclComm(int rank, int world, int device, std::shared_ptr<Store> store,
           std::vector<NcclLink> links, std::chrono::milliseconds timeout,
           std::string prefix = "baton/nccl_comm",
           std::chrono::milliseconds setup_timeout = std::chrono::milliseconds(0));
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // True when built with CUDA and NCCL (constructing may still fail).
  static bool built();

  // Settings; on a lead context also applied to every routed slot's.
  void set_timeout(std::chrono::milliseconds timeout);
  void set_layout(int channel, int stage, std::vector<size_t> bytes);
  void set_names(int peer, int channel, bool send, std::vector<std::string> names);
  void record(bool on);
  // Allocates the staging slots and events of the transfers in flight at once
  // (reservation()) and caps the pool; call after set_layout, before the first
  // step. ExecutionError naming the rank, the direction and the bytes when the
  // slots cannot be allocated. The counts form reserves every transfer of a step.
  void reserve(const std::vector<staging::InFlight>& transfers);
  void reserve(const std::vector<staging::TransferCount>& transfers);
  // (send, receive) bytes of staging reserved by reserve() (merged over the
  // calls: staging::merged), this context's and its routed slots'; (0, 0) before.
  std::pair<size_t, size_t> reserved_bytes() const;

  // Device slots (see the header comment): calls from device `ordinal` run on
  // `member` (null removes the route). Set while no program runs.
  void set_route(int ordinal, std::shared_ptr<NcclComm> member);
  // The context of a call from device `ordinal`: the routed slot's, else this
  // one when `ordinal` is its own device or no routes are set (one slot);
  // ExecutionError naming the rank and the ordinals otherwise (a handler called
  // on a device this rank lacks).
  NcclComm& route(int ordinal);

  // One group (see RankComm::run_group); `stream` is the compute stream
  // (cudaStream_t), the byte ranges are device memory. Throws ExecutionError
  // (after aborting and recording the failure).
  void run_group(void* stream, const std::vector<CommOp>& ops, const std::vector<ConstBytes>& sends,
                 const std::vector<MutBytes>& outs);
  // Waits (bounded, polling) for every send posted so far; fails when a
  // failure is known (also one the watchdog found).
  void drain(void* stream);
  void mark(void* stream, int phase);
  void abort(const std::string& msg, int origin);  // never throws
  // Destroys the communicators (aborts them if failed); later calls fail.
  void close();

  // The first failure of this context or of a routed slot's.
  std::optional<std::pair<int, std::string>> failure() const;
  std::vector<std::pair<int, Clock::time_point>> take_marks();
  std::vector<CommEvent> take_events();
  std::pair<uint64_t, uint64_t> counts() const;
  int rank() const;
  int world_size() const;
  int device() const;
  bool alive() const;  // communicators up and no failure
  std::vector<NcclLink> links() const;
  // Staging slots allocated so far (the pool's size; tests and benchmarks), this
  // context's and its routed slots'.
  size_t slots_allocated() const;
  // CUDA events created so far (this context's and its routed slots').
  size_t events_created() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  SlotRoutes<NcclComm> routes_;
};

// NcclComm contexts by id for the CUDA FFI handlers; ids are never reused and
// never collide with register_comm's (they start at 2^40).
int64_t register_nccl_comm(std::shared_ptr<NcclComm> comm);
void unregister_nccl_comm(int64_t id);
std::shared_ptr<NcclComm> find_nccl_comm(int64_t id);  // null when unknown

// Closes every NcclComm still alive that was ever registered, all at once (one
// thread each, staging::run_concurrently), each waiting only for its own streams:
// called at interpreter exit (baton.emit.ffi registers it with atexit), before
// JAX's client and the CUDA runtime are torn down. How many it closed.
size_t close_all_nccl_comms();

}  // namespace baton::runtime
