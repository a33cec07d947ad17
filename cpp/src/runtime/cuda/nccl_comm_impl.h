// Internal (not installed): NcclComm::Impl, the state of one NCCL transfer
// context, shared by nccl_comm.cc (the public methods) and the nccl_comm_*.cc
// files that implement it (setup, events, transfers, watchdog).
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "baton/nccl_comm.h"
#include "nccl_api.h"

namespace baton::runtime {

using nccl_detail::accepted;
using nccl_detail::cuda_check;
using nccl_detail::nccl_api;
using nccl_detail::nccl_check;
using staging::LinkKey;

struct NcclComm::Impl {
  // One direction of a link: its communicator (rank 0 sends, rank 1 receives)
  // and the only stream that uses it on this rank.
  struct Link {
    LinkKey key;
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
  };
  struct PendingSend {
    cudaEvent_t done = nullptr;  // on the link's send stream, after ncclSend
    void* slot = nullptr;
    size_t bytes = 0;
    std::string what;
  };
  struct PendingRecv {
    cudaEvent_t done = nullptr;  // on the link's receive stream, after ncclRecv
    void* slot = nullptr;
    size_t bytes = 0;
    std::string what;
  };
  // A receive the compute stream waits for (the watchdog's).
  struct Watched {
    cudaEvent_t reached = nullptr;  // compute stream at the wait
    cudaEvent_t done = nullptr;
    std::string what;
    bool seen = false;  // `reached` completed, at `since`
    Clock::time_point since{};
  };
  struct Timed {
    size_t event;  // index into events_
    cudaEvent_t start = nullptr, end = nullptr;
  };
  struct TimedMark {
    int phase;
    cudaEvent_t ev = nullptr;
  };

  Impl(int rank, int world, int device, std::shared_ptr<Store> store, std::vector<NcclLink> links,
       std::chrono::milliseconds timeout, std::string prefix,
       std::chrono::milliseconds setup_timeout);
  ~Impl();

  // ---- events
  cudaEvent_t fast_event();  // timing disabled; XLA thread
  void give_fast(cudaEvent_t e) { fast_.push_back(e); }
  cudaEvent_t timed_event();                         // under mu_
  Clock::time_point host_time(cudaEvent_t e) const;  // under mu_; {} when not complete

  // ---- operations (XLA thread)
  void set_device() const { cuda_check(cudaSetDevice(device_), "cudaSetDevice"); }
  Link& link(int src, int dst, int channel, const CommOp& op);
  const std::vector<size_t>& layout(int channel, int stage) const;
  std::string name(const CommOp& op, uint64_t seq) const;
  void send(cudaStream_t stream, const CommOp& op, const std::vector<ConstBytes>& sends,
            size_t& in);
  void post(const CommOp& op);
  void wait(cudaStream_t stream, const CommOp& op, const std::vector<MutBytes>& outs, size_t& out);
  void reap(bool all);
  // A non-blocking call on `l` returned ncclInProgress: polls it (the lock only
  // around each poll) until it is enqueued, within the timeout.
  void settle(Link& l, const std::string& doing);
  void reserve_events(size_t n);  // at least n idle fast events
  // Allocates what `want` says and caps the pool (NcclComm::reserve).
  void reserve(const staging::Reservation& want);
  // A staging slot of `bytes` for a transfer (`what`): from the pool; once the
  // pool is capped, waits within the timeout for one to come free (reaping
  // completed sends), else ExecutionError naming the rank, direction and bytes.
  void* slot(size_t bytes, bool send, const std::string& what);
  // Issues every pair of a staged self send and a posted self receive of `channel`.
  void pair_self(Link& l, int channel);
  void take_spent();
  void check_failed() const;
  // nccl_mu_, held for NCCL calls on the links' communicators; raises the failure (or
  // "gone") instead when an abort or close took the communicators meanwhile.
  std::unique_lock<std::mutex> comms_lock();
  [[noreturn]] void fail(const std::string& msg, int origin);
  size_t note(CommOpKind kind, const CommOp& op, uint64_t seq, cudaStream_t s);
  void note_end(size_t rec, cudaStream_t s);

  // ---- failures (any thread)
  void abort(const std::string& msg, int origin, bool publish);
  void abort_comms();
  // Under mu_: watched receives whose events completed go to spent_; the
  // message of one the compute stream has waited for past the timeout, if any.
  std::string sweep_watched_locked();
  void watchdog();
  void close();

  const int rank_, world_, device_;
  std::shared_ptr<Store> store_;
  const std::vector<NcclLink> links_in_;
  const std::string prefix_;
  std::atomic<int64_t> timeout_ms_;

  std::map<LinkKey, Link> links_;
  CommLayouts layouts_;
  std::map<std::tuple<int, int, bool>, std::vector<std::string>> names_;
  staging::LinkFifo<PendingRecv> fifo_;
  std::vector<PendingSend> sends_;
  // Self links (a rank sending to itself): NCCL needs a send to self and its
  // receive in one group, so each is held until its partner comes (pair_self).
  std::map<int, std::deque<PendingSend>> self_sends_;   // by channel: staged, not issued
  std::map<int, std::deque<PendingRecv*>> self_recvs_;  // by channel: posted, not issued
  std::unique_ptr<staging::SlotPool> pool_;
  staging::Reservation reserved_;  // what reserve() allocated (empty before)
  std::vector<cudaEvent_t> fast_;

  // mu_ guards what other threads read or write: failure, watched receives,
  // spent events, recording.
  mutable std::mutex mu_;
  std::optional<std::pair<int, std::string>> failure_;
  std::vector<Watched> watched_;
  std::vector<cudaEvent_t> spent_;  // fast events the watchdog is done with
  bool record_ = false;
  std::vector<CommEvent> events_;
  std::vector<Timed> timed_;
  std::vector<TimedMark> marks_;
  std::vector<cudaEvent_t> timed_free_;
  cudaEvent_t anchor_ = nullptr;
  cudaStream_t anchor_stream_ = nullptr;
  Clock::time_point anchor_time_{};

  // nccl_mu_: every NCCL call on links_' communicators vs abort_comms().
  std::mutex nccl_mu_;
  staging::AbortOnce gone_;  // communicators aborted or destroyed (once)
  std::atomic<bool> closed_{false};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> sent_{0}, received_{0};
  std::atomic<size_t> events_created_{0};
  std::thread watchdog_;
};

}  // namespace baton::runtime
