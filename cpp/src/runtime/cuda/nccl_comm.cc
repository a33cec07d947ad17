// NcclComm: a rank program's transfers over NCCL on XLA's CUDA stream (see
// nccl_comm.h for the design: staging slots, one communicator per link and
// direction, the watchdog). Built only when CUDA and nccl.h are found.
#include "baton/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "nccl_api.h"
#include "../wire.h"

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
  cudaEvent_t timed_event();  // under mu_
  Clock::time_point host_time(cudaEvent_t e) const;  // under mu_; {} when not complete

  // ---- operations (XLA thread)
  void set_device() const { cuda_check(cudaSetDevice(device_), "cudaSetDevice"); }
  Link& link(int src, int dst, int channel, const CommOp& op);
  const std::vector<size_t>& layout(int channel, int stage) const;
  std::string name(const CommOp& op, uint64_t seq) const;
  void send(cudaStream_t stream, const CommOp& op, const std::vector<ConstBytes>& sends, size_t& in);
  void post(const CommOp& op);
  void wait(cudaStream_t stream, const CommOp& op, const std::vector<MutBytes>& outs, size_t& out);
  void reap(bool all);
  // A non-blocking call on `l` returned ncclInProgress: polls it (the lock only
  // around each poll) until it is enqueued, within the timeout.
  void settle(Link& l, const std::string& doing);
  void reserve_events(size_t n);  // at least n idle fast events
  // Issues every pair of a staged self send and a posted self receive of `channel`.
  void pair_self(Link& l, int channel);
  void take_spent();
  void check_failed() const;
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
  std::map<int, std::deque<PendingSend>> self_sends_;  // by channel: staged, not issued
  std::map<int, std::deque<PendingRecv*>> self_recvs_;  // by channel: posted, not issued
  std::unique_ptr<staging::SlotPool> pool_;
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

// ---------------------------------------------------------------- setup

NcclComm::Impl::Impl(int rank, int world, int device, std::shared_ptr<Store> store,
                     std::vector<NcclLink> links, std::chrono::milliseconds timeout,
                     std::string prefix, std::chrono::milliseconds setup_timeout)
    : rank_(rank),
      world_(world),
      device_(device),
      store_(std::move(store)),
      links_in_(std::move(links)),
      prefix_(std::move(prefix)),
      timeout_ms_(timeout.count()) {
  if (!store_) throw ConfigError("NcclRankComm: a rendezvous store is required");
  if (world < 1 || rank < 0 || rank >= world)
    throw ConfigError(fmt::format("NcclRankComm: rank {} is invalid for world size {}", rank, world));
  const std::vector<LinkKey> keys = staging::canonical_links(rank, world, links_in_);
  int count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the error state
    throw ConfigError(fmt::format(
        "NcclRankComm needs a CUDA device, and there is none{}",
        ce != cudaSuccess ? fmt::format(" (cudaGetDeviceCount: {})", cudaGetErrorString(ce)) : ""));
  }
  if (device < 0 || device >= count)
    throw ConfigError(
        fmt::format("NcclRankComm: CUDA device {} does not exist ({} visible)", device, count));
  const auto& api = nccl_api();
  if (!api.lib) throw ConfigError(fmt::format("NcclRankComm: cannot load NCCL: {}", api.error));
  set_device();

  pool_ = std::make_unique<staging::SlotPool>(
      [](size_t n) {
        void* p = nullptr;
        cuda_check(cudaMalloc(&p, n), "cudaMalloc (staging slot)");
        return p;
      },
      [](void* p) { cudaFree(p); },
      [](void* fence) { return cudaEventQuery(static_cast<cudaEvent_t>(fence)) == cudaSuccess; },
      [this](void* fence) { give_fast(static_cast<cudaEvent_t>(fence)); });

  // Unique ids: the sender of a link makes it, the receiver reads it. Every
  // rank sets all of its ids before reading any, so no rank waits on another's get.
  auto id_key = [&](const LinkKey& k) {
    return fmt::format("{}/id/{}-{}-{}", prefix_, k.src, k.dst, k.channel);
  };
  std::vector<ncclUniqueId> ids(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].src != rank_) continue;
    nccl_check(api.GetUniqueId(&ids[i]), "ncclGetUniqueId");
    store_->set(id_key(keys[i]), std::string(reinterpret_cast<const char*>(&ids[i]), sizeof(ncclUniqueId)));
  }
  const auto connect = setup_timeout.count() > 0
                           ? setup_timeout
                           : std::max(timeout, std::chrono::milliseconds(60000));
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].src == rank_) continue;
    std::string v;
    try {
      v = store_->get(id_key(keys[i]), connect);
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("rank {}: NCCL setup: the link {}->{} channel {} from peer "
                                       "rank {} got no NCCL id within {:g} s (the peer never "
                                       "arrived): {}",
                                       rank_, keys[i].src, keys[i].dst, keys[i].channel,
                                       keys[i].src, comm_seconds(connect), e.what()),
                           rank_);
    }
    if (v.size() != sizeof(ncclUniqueId))
      throw ExecutionError(fmt::format("rank {}: malformed NCCL unique id in the store", rank_),
                           rank_);
    std::memcpy(&ids[i], v.data(), sizeof(ncclUniqueId));
  }
  const auto deadline = Clock::now() + connect;
  // The link of communicator i of `comms` (in links_' order), for messages.
  auto describe = [this](size_t i) {
    auto it = links_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(i));
    const LinkKey& k = it->first;
    return fmt::format("the link {}->{} channel {} ({} rank {}, CUDA device {})", k.src, k.dst,
                       k.channel, k.src == rank_ ? "to peer" : "from peer",
                       k.src == rank_ ? k.dst : k.src, device_);
  };
  auto comms = [this] {
    std::vector<ncclComm_t> out;
    for (auto& [k, l] : links_) out.push_back(l.comm);
    return out;
  };
  void* warm = nullptr;
  try {
    for (const LinkKey& k : keys) {
      Link l;
      l.key = k;
      cuda_check(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      links_.emplace(k, l);
    }
    // All communicators in one group (canonical order), non-blocking: the
    // host never blocks in an init its peer has not reached; wait_ready polls
    // them under the deadline.
    nccl_check(api.GroupStart(), "ncclGroupStart");
    ncclResult_t init = ncclSuccess;
    for (size_t i = 0; i < keys.size() && (init == ncclSuccess || init == ncclInProgress); ++i) {
      ncclConfig_t cfg = nccl_detail::nonblocking_config();
      const bool self = keys[i].src == keys[i].dst;  // a self link: a 1-rank communicator
      init = api.CommInitRankConfig(&links_.at(keys[i]).comm, self ? 1 : 2, ids[i],
                                    keys[i].src == rank_ ? 0 : 1, &cfg);
    }
    const ncclResult_t end = api.GroupEnd();
    accepted(init, "ncclCommInitRankConfig");
    accepted(end, "ncclGroupEnd (ncclCommInitRankConfig)");
    const std::string doing = fmt::format("rank {}: NCCL setup", rank_);
    nccl_detail::wait_ready(comms(), deadline, describe, doing);
    // Connect every link now (grouped): a first ncclSend would otherwise make
    // NCCL connect inside a step.
    cuda_check(cudaMalloc(&warm, 2), "cudaMalloc");
    nccl_check(api.GroupStart(), "ncclGroupStart");
    ncclResult_t r = ncclSuccess;
    for (auto& [k, l] : links_) {
      if (r != ncclSuccess && r != ncclInProgress) break;
      if (k.src == k.dst) {  // a self link: its send and receive in the same group
        r = api.Send(warm, 1, ncclUint8, 0, l.comm, l.stream);
        if (r == ncclSuccess || r == ncclInProgress)
          r = api.Recv(static_cast<char*>(warm) + 1, 1, ncclUint8, 0, l.comm, l.stream);
        continue;
      }
      r = k.src == rank_ ? api.Send(warm, 1, ncclUint8, 1, l.comm, l.stream)
                         : api.Recv(static_cast<char*>(warm) + 1, 1, ncclUint8, 0, l.comm, l.stream);
    }
    const ncclResult_t wend = api.GroupEnd();
    accepted(r, "ncclSend/ncclRecv (connecting)");
    accepted(wend, "ncclGroupEnd (connecting)");
    nccl_detail::wait_ready(comms(), deadline, describe,
                            fmt::format("rank {}: connecting NCCL links", rank_));
    size_t i = 0;
    for (auto& [k, l] : links_) {
      for (;;) {
        const cudaError_t q = cudaStreamQuery(l.stream);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) cuda_check(q, "cudaStreamQuery (connecting)");
        ncclResult_t async = ncclSuccess;
        api.CommGetAsyncError(l.comm, &async);
        if (async != ncclInProgress) nccl_check(async, "NCCL (connecting)");
        if (Clock::now() > deadline)
          throw ExecutionError(fmt::format("rank {}: {} did not connect within {:g} s (the peer "
                                           "never arrived; communicators aborted)",
                                           rank_, describe(i), comm_seconds(connect)),
                               rank_);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      ++i;
    }
    cudaFree(warm);
    warm = nullptr;
  } catch (const std::exception& e) {
    // No lock is held here: ncclCommAbort ends the pending setup at once.
    abort_comms();
    cudaDeviceSynchronize();  // the aborted kernels end (the 1-byte warm-up)
    (void)cudaGetLastError();
    if (warm) cudaFree(warm);
    for (auto& [k, l] : links_)
      if (l.stream) cudaStreamDestroy(l.stream);
    links_.clear();
    if (dynamic_cast<const ExecutionError*>(&e)) {
      const std::string msg = e.what();
      throw ExecutionError(msg.rfind(fmt::format("rank {}", rank_), 0) == 0
                               ? msg
                               : fmt::format("rank {}: {}", rank_, msg),
                           rank_);
    }
    throw;
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

NcclComm::Impl::~Impl() {
  try {
    close();
  } catch (...) {
  }
}

void NcclComm::Impl::close() {
  if (closed_.exchange(true)) return;
  stop_ = true;
  if (watchdog_.joinable()) watchdog_.join();
  cudaSetDevice(device_);
  // Communicators with transfers still pending are aborted, else destroyed.
  bool idle = true;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_.load());
  for (auto& [k, l] : links_) {
    while (cudaStreamQuery(l.stream) == cudaErrorNotReady) {
      if (gone_.done() || Clock::now() > deadline) {
        idle = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!idle) break;
  }
  if (!idle) abort(fmt::format("rank {}: closed with transfers pending", rank_), rank_, false);
  {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    if (gone_.first())
      for (auto& [k, l] : links_)
        if (l.comm) nccl_api().CommDestroy(l.comm);
  }
  // Aborted NCCL kernels end, so nothing on the device waits forever now.
  cudaDeviceSynchronize();
  (void)cudaGetLastError();
  for (auto& [k, l] : links_) cudaStreamDestroy(l.stream);
  links_.clear();
  for (PendingSend& s : sends_) {
    pool_->retire(s.slot, s.bytes, nullptr);
    cudaEventDestroy(s.done);
  }
  sends_.clear();
  for (auto& [c, q] : self_sends_)  // staged sends to itself never paired (no event yet)
    for (PendingSend& s : q) pool_->retire(s.slot, s.bytes, nullptr);
  self_sends_.clear();
  self_recvs_.clear();  // (their entries are in fifo_, dropped below)
  while (fifo_.pending()) {
    // drop posted receives that were never waited for
    bool any = false;
    for (const NcclLink& l : links_in_) {
      while (!fifo_.empty(l.peer, l.channel)) {
        PendingRecv p = fifo_.pop(l.peer, l.channel);
        pool_->retire(p.slot, p.bytes, nullptr);
        cudaEventDestroy(p.done);
        any = true;
      }
    }
    if (!any) break;
  }
  pool_.reset();  // frees every slot (the device is idle)
  std::lock_guard<std::mutex> lock(mu_);
  for (Watched& w : watched_) {
    cudaEventDestroy(w.reached);
    cudaEventDestroy(w.done);
  }
  watched_.clear();
  for (cudaEvent_t e : spent_) cudaEventDestroy(e);
  spent_.clear();
  for (cudaEvent_t e : fast_) cudaEventDestroy(e);
  fast_.clear();
  for (Timed& t : timed_) {
    cudaEventDestroy(t.start);
    cudaEventDestroy(t.end);
  }
  timed_.clear();
  for (TimedMark& m : marks_) cudaEventDestroy(m.ev);
  marks_.clear();
  for (cudaEvent_t e : timed_free_) cudaEventDestroy(e);
  timed_free_.clear();
  if (anchor_) cudaEventDestroy(anchor_);
  if (anchor_stream_) cudaStreamDestroy(anchor_stream_);
  anchor_ = nullptr;
  anchor_stream_ = nullptr;
}

// ---------------------------------------------------------------- events

cudaEvent_t NcclComm::Impl::fast_event() {
  if (fast_.empty()) take_spent();
  if (fast_.empty()) {  // completed receives the watchdog has not swept yet
    {
      std::lock_guard<std::mutex> lock(mu_);
      sweep_watched_locked();  // (a timeout found here is the watchdog's to report)
    }
    take_spent();
  }
  if (!fast_.empty()) {
    cudaEvent_t e = fast_.back();
    fast_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  ++events_created_;
  return e;
}

void NcclComm::Impl::reserve_events(size_t n) {
  take_spent();
  while (fast_.size() < n) {
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate (reserve)");
    ++events_created_;
    fast_.push_back(e);
  }
}

void NcclComm::Impl::pair_self(Link& l, int channel) {
  auto& sends = self_sends_[channel];
  auto& recvs = self_recvs_[channel];
  const nccl_detail::NcclApi& api = nccl_api();
  while (!sends.empty() && !recvs.empty()) {
    PendingSend s = std::move(sends.front());
    sends.pop_front();
    PendingRecv* r = recvs.front();
    recvs.pop_front();
    if (s.bytes != r->bytes)
      throw ExecutionError(fmt::format("rank {}: {} ({} bytes) to itself is received as {} ({} "
                                       "bytes)",
                                       rank_, s.what, s.bytes, r->what, r->bytes),
                           rank_);
    if (s.bytes) {
      ncclResult_t a = ncclSuccess, b = ncclSuccess, e = ncclSuccess;
      {
        std::lock_guard<std::mutex> lock(nccl_mu_);
        if (gone_.done()) {
          check_failed();
          throw ExecutionError(fmt::format("rank {}: the NCCL communicators are gone", rank_),
                               rank_);
        }
        nccl_check(api.GroupStart(), "ncclGroupStart (self link)");
        a = api.Send(s.slot, s.bytes, ncclUint8, 0, l.comm, l.stream);
        b = api.Recv(r->slot, r->bytes, ncclUint8, 0, l.comm, l.stream);
        e = api.GroupEnd();
      }
      accepted(a, "ncclSend (self link)");
      accepted(b, "ncclRecv (self link)");
      accepted(e, "ncclGroupEnd (self link)");
      if (a == ncclInProgress || b == ncclInProgress || e == ncclInProgress)
        settle(l, "sending " + s.what + " to itself");
    }
    s.done = fast_event();
    cuda_check(cudaEventRecord(s.done, l.stream), "cudaEventRecord");
    cuda_check(cudaEventRecord(r->done, l.stream), "cudaEventRecord");
    sends_.push_back(std::move(s));
  }
}

void NcclComm::Impl::settle(Link& l, const std::string& doing) {
  const LinkKey k = l.key;
  nccl_detail::wait_ready(
      {l.comm}, Clock::now() + std::chrono::milliseconds(timeout_ms_.load()),
      [&](size_t) {
        return fmt::format("the link {}->{} channel {} (peer rank {})", k.src, k.dst, k.channel,
                           k.src == rank_ ? k.dst : k.src);
      },
      fmt::format("rank {}: {}", rank_, doing), &nccl_mu_, [this] { return gone_.done(); });
}

cudaEvent_t NcclComm::Impl::timed_event() {
  if (!timed_free_.empty()) {
    cudaEvent_t e = timed_free_.back();
    timed_free_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  ++events_created_;
  return e;
}

Clock::time_point NcclComm::Impl::host_time(cudaEvent_t e) const {
  if (!anchor_ || !e || cudaEventQuery(e) != cudaSuccess) return {};
  float ms = 0.0f;
  if (cudaEventElapsedTime(&ms, anchor_, e) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  return anchor_time_ + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double, std::milli>(static_cast<double>(ms)));
}

void NcclComm::Impl::take_spent() {
  std::lock_guard<std::mutex> lock(mu_);
  fast_.insert(fast_.end(), spent_.begin(), spent_.end());
  spent_.clear();
}

size_t NcclComm::Impl::note(CommOpKind kind, const CommOp& op, uint64_t seq, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!record_) return SIZE_MAX;
  events_.push_back({kind, op.peer, op.channel, op.stage, seq, Clock::now(), {}, {}});
  Timed t{events_.size() - 1, timed_event(), timed_event()};
  cuda_check(cudaEventRecord(t.start, s), "cudaEventRecord");
  timed_.push_back(t);
  return timed_.size() - 1;
}

void NcclComm::Impl::note_end(size_t rec, cudaStream_t s) {
  if (rec == SIZE_MAX) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (rec < timed_.size()) cuda_check(cudaEventRecord(timed_[rec].end, s), "cudaEventRecord");
}

// ---------------------------------------------------------------- operations

void NcclComm::Impl::check_failed() const {
  if (closed_) throw ExecutionError(fmt::format("rank {}: the NCCL context is closed", rank_), rank_);
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_) throw ExecutionError(failure_->second, failure_->first);
}

void NcclComm::Impl::fail(const std::string& msg, int origin) {
  abort(msg, origin, true);
  std::lock_guard<std::mutex> lock(mu_);
  throw ExecutionError(failure_ ? failure_->second : msg, failure_ ? failure_->first : origin);
}

NcclComm::Impl::Link& NcclComm::Impl::link(int src, int dst, int channel, const CommOp& op) {
  auto it = links_.find(LinkKey{src, dst, channel});
  if (it == links_.end())
    throw ExecutionError(
        fmt::format("rank {}: internal: {} of the {} buffer of stage {} {} rank {} uses the NCCL "
                    "link {}->{} channel {}, which was not given when the context was made",
                    rank_, src == rank_ ? "a send" : "a receive", comm_channel_name(channel),
                    op.stage, src == rank_ ? "to" : "from", op.peer, src, dst, channel),
        rank_);
  return it->second;
}

const std::vector<size_t>& NcclComm::Impl::layout(int channel, int stage) const {
  return comm_layout(layouts_, rank_, channel, stage);
}

std::string NcclComm::Impl::name(const CommOp& op, uint64_t seq) const {
  const bool send = op.kind == CommOpKind::Send;
  auto it = names_.find({op.peer, op.channel, send});
  if (it != names_.end() && !it->second.empty())
    return fmt::format("{} {} rank {}", it->second[seq % it->second.size()], send ? "to" : "from",
                       op.peer);
  return fmt::format("{}(stage {}) #{} {} rank {}", comm_channel_name(op.channel), op.stage, seq,
                     send ? "to" : "from", op.peer);
}

void NcclComm::Impl::reap(bool all) {
  size_t keep = 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_.load());
  for (size_t i = 0; i < sends_.size(); ++i) {
    PendingSend& s = sends_[i];
    cudaError_t q = cudaEventQuery(s.done);
    if (all) {
      int spins = 0;
      while (q == cudaErrorNotReady) {
        check_failed();  // the watchdog or another rank failed: stop waiting
        if (Clock::now() > deadline)
          fail(fmt::format("rank {}: timed out after {:g} s sending {}", rank_,
                           comm_seconds(std::chrono::milliseconds(timeout_ms_.load())), s.what),
               rank_);
        std::this_thread::sleep_for(std::chrono::microseconds(spins++ < 100 ? 10 : 200));
        q = cudaEventQuery(s.done);
      }
    }
    if (q == cudaSuccess) {
      pool_->retire(s.slot, s.bytes, nullptr);
      give_fast(s.done);
    } else if (q == cudaErrorNotReady) {
      if (keep != i) sends_[keep] = std::move(s);
      ++keep;
    } else {
      cuda_check(q, "cudaEventQuery (send)");
    }
  }
  sends_.resize(keep);
}

void NcclComm::Impl::send(cudaStream_t stream, const CommOp& op,
                          const std::vector<ConstBytes>& sends, size_t& in) {
  const auto& sizes = layout(op.channel, op.stage);
  if (in + sizes.size() > sends.size())
    throw ExecutionError(fmt::format("rank {}: internal: a send group has too few inputs", rank_),
                         rank_);
  for (size_t i = 0; i < sizes.size(); ++i)
    if (sends[in + i].size != sizes[i])
      throw ExecutionError(
          fmt::format("rank {}: sending the {} buffer of stage {} to rank {}: tensor {} has {} "
                      "bytes, the receiver expects {}",
                      rank_, comm_channel_name(op.channel), op.stage, op.peer, i,
                      sends[in + i].size, sizes[i]),
          rank_);
  Link& l = link(rank_, op.peer, op.channel, op);
  const std::vector<size_t> offs = staging::packed_offsets(sizes);
  const size_t total = offs.back();
  const uint64_t seq = fifo_.next_send(op.peer, op.channel);
  PendingSend p;
  p.what = name(op, seq);
  p.bytes = total;
  p.slot = pool_->take(total);
  // XLA's buffer -> slot on the compute stream; the send stream waits for it.
  for (size_t i = 0; i < sizes.size(); ++i, ++in)
    if (sizes[i])
      cuda_check(cudaMemcpyAsync(static_cast<char*>(p.slot) + offs[i], sends[in].data, sizes[i],
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (send staging)");
  cudaEvent_t copied = fast_event();
  cuda_check(cudaEventRecord(copied, stream), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(l.stream, copied, 0), "cudaStreamWaitEvent");
  give_fast(copied);  // the wait above captured it: free to re-record
  if (op.peer == rank_) {  // a self link: issued with its receive (pair_self)
    self_sends_[op.channel].push_back(std::move(p));
    pair_self(l, op.channel);
    ++sent_;
    return;
  }
  const size_t rec = note(CommOpKind::Send, op, seq, l.stream);
  if (total) {
    ncclResult_t r = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (gone_.done()) {  // aborted or closed meanwhile
        check_failed();
        throw ExecutionError(fmt::format("rank {}: the NCCL communicators are gone", rank_), rank_);
      }
      r = nccl_api().Send(p.slot, total, ncclUint8, 1, l.comm, l.stream);
    }
    accepted(r, "ncclSend");
    if (r == ncclInProgress) settle(l, "sending " + p.what);
  }
  note_end(rec, l.stream);
  p.done = fast_event();
  cuda_check(cudaEventRecord(p.done, l.stream), "cudaEventRecord");
  sends_.push_back(std::move(p));
  ++sent_;
}

void NcclComm::Impl::post(const CommOp& op) {
  Link& l = link(op.peer, rank_, op.channel, op);
  const size_t total = staging::packed_offsets(layout(op.channel, op.stage)).back();
  const uint64_t seq = fifo_.next_recv(op.peer, op.channel);
  PendingRecv p;
  p.what = name(op, seq);
  p.bytes = total;
  // A slot from the pool is idle on the device (its fences completed), so the
  // receive stream needs no wait on the compute stream.
  p.slot = pool_->take(total);
  if (op.peer == rank_) {  // a self link: issued with its send (pair_self)
    p.done = fast_event();
    fifo_.push(op.peer, op.channel, std::move(p));
    self_recvs_[op.channel].push_back(&fifo_.back(op.peer, op.channel));
    pair_self(l, op.channel);
    ++received_;
    return;
  }
  const size_t rec = note(CommOpKind::Post, op, seq, l.stream);
  if (total) {
    ncclResult_t r = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (gone_.done()) {  // aborted or closed meanwhile
        check_failed();
        throw ExecutionError(fmt::format("rank {}: the NCCL communicators are gone", rank_), rank_);
      }
      r = nccl_api().Recv(p.slot, total, ncclUint8, 0, l.comm, l.stream);
    }
    accepted(r, "ncclRecv");
    if (r == ncclInProgress) settle(l, "posting the receive of " + p.what);
  }
  note_end(rec, l.stream);
  p.done = fast_event();
  cuda_check(cudaEventRecord(p.done, l.stream), "cudaEventRecord");
  fifo_.push(op.peer, op.channel, std::move(p));
  ++received_;
}

void NcclComm::Impl::wait(cudaStream_t stream, const CommOp& op, const std::vector<MutBytes>& outs,
                          size_t& out) {
  if (fifo_.empty(op.peer, op.channel)) post(op);  // not posted ahead: post it now
  if (op.peer == rank_) {
    auto& pending = self_recvs_[op.channel];
    if (!pending.empty() && pending.front() == &fifo_.front(op.peer, op.channel))
      throw ExecutionError(
          fmt::format("rank {}: receiving {} from itself before it was sent (a self link's "
                      "send must come before its wait in the rank's stream)",
                      rank_, fifo_.front(op.peer, op.channel).what),
          rank_);
  }
  PendingRecv p = fifo_.pop(op.peer, op.channel);
  const auto& sizes = layout(op.channel, op.stage);
  const std::vector<size_t> offs = staging::packed_offsets(sizes);
  if (offs.back() != p.bytes)
    throw ExecutionError(fmt::format("rank {}: receiving {}: posted for {} bytes, waited for as {}",
                                     rank_, p.what, p.bytes, offs.back()),
                         rank_);
  if (out + sizes.size() > outs.size())
    throw ExecutionError(
        fmt::format("rank {}: internal: a receive group has too few results", rank_), rank_);
  for (size_t i = 0; i < sizes.size(); ++i)
    if (outs[out + i].size != sizes[i])
      throw ExecutionError(fmt::format("rank {}: receiving {}: tensor {} has {} bytes, expected {}",
                                       rank_, p.what, i, sizes[i], outs[out + i].size),
                           rank_);
  Watched w;
  w.reached = fast_event();
  w.done = p.done;
  w.what = p.what;
  cuda_check(cudaEventRecord(w.reached, stream), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(stream, p.done, 0), "cudaStreamWaitEvent");
  for (size_t i = 0; i < sizes.size(); ++i, ++out)
    if (sizes[i])
      cuda_check(cudaMemcpyAsync(outs[out].data, static_cast<const char*>(p.slot) + offs[i],
                                 sizes[i], cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (receive staging)");
  cudaEvent_t copied = fast_event();
  cuda_check(cudaEventRecord(copied, stream), "cudaEventRecord");
  pool_->retire(p.slot, p.bytes, copied);
  std::lock_guard<std::mutex> lock(mu_);
  watched_.push_back(std::move(w));
}

// ---------------------------------------------------------------- failures

void NcclComm::Impl::abort_comms() {
  std::lock_guard<std::mutex> lock(nccl_mu_);
  if (!gone_.first()) return;
  for (auto& [k, l] : links_)
    if (l.comm) nccl_api().CommAbort(l.comm);
}

void NcclComm::Impl::abort(const std::string& msg, int origin, bool publish) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) {
      failure_ = std::make_pair(origin, msg);
      first = true;
    }
  }
  try {
    abort_comms();
  } catch (...) {
  }
  if (first && publish) {
    try {
      store_->set(prefix_ + "/abort", wire::encode_abort_note(origin, msg));
    } catch (...) {
    }
  }
}

std::string NcclComm::Impl::sweep_watched_locked() {
  std::string timed_out;
  const auto now = Clock::now();
  const auto limit = std::chrono::milliseconds(timeout_ms_.load());
  size_t keep = 0;
  for (size_t i = 0; i < watched_.size(); ++i) {
    Watched& w = watched_[i];
    if (cudaEventQuery(w.done) == cudaSuccess) {
      // `reached` precedes `done`'s consumer on the compute stream; wait for
      // it too so the event is idle before it is re-recorded.
      if (cudaEventQuery(w.reached) == cudaSuccess) {
        spent_.push_back(w.reached);
        spent_.push_back(w.done);
        continue;
      }
    } else if (!w.seen) {
      if (cudaEventQuery(w.reached) == cudaSuccess) {
        w.seen = true;
        w.since = now;
      }
    } else if (now - w.since > limit && timed_out.empty() && !failure_) {
      timed_out = fmt::format("rank {}: timed out after {:g} s receiving {} (the compute "
                              "stream waited for it; NCCL communicators aborted)",
                              rank_, comm_seconds(limit), w.what);
    }
    if (keep != i) watched_[keep] = std::move(watched_[i]);
    ++keep;
  }
  watched_.resize(keep);
  return timed_out;
}

void NcclComm::Impl::watchdog() {
  cudaSetDevice(device_);
  const std::string abort_key = prefix_ + "/abort";
  while (!stop_) {
    // 1. receives the compute stream waits for
    std::string timed_out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      timed_out = sweep_watched_locked();
    }
    if (!timed_out.empty()) abort(timed_out, rank_, true);
    // 2. asynchronous NCCL errors
    std::string async_error;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (!gone_.done())
        for (auto& [k, l] : links_) {
          ncclResult_t r = ncclSuccess;
          nccl_api().CommGetAsyncError(l.comm, &r);
          if (r != ncclSuccess && r != ncclInProgress) {
            async_error = fmt::format("rank {}: NCCL error on link {}->{} channel {}: {}", rank_,
                                      k.src, k.dst, k.channel, nccl_api().GetErrorString(r));
            break;
          }
        }
    }
    if (!async_error.empty()) abort(async_error, rank_, true);
    // 3. another rank's failure (the store wait is this loop's pause)
    bool known = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      known = failure_.has_value();
    }
    const auto t0 = Clock::now();
    if (!known) {
      try {
        const wire::AbortNote note =
            wire::decode_abort_note(store_->get(abort_key, std::chrono::milliseconds(100)), world_);
        abort(note.reason, note.origin, false);
      } catch (const std::exception&) {
        // not set yet
      }
    }
    if (Clock::now() - t0 < std::chrono::milliseconds(20))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// ---------------------------------------------------------------- NcclComm

NcclComm::NcclComm(int rank, int world, int device, std::shared_ptr<Store> store,
                   std::vector<NcclLink> links, std::chrono::milliseconds timeout,
                   std::string prefix, std::chrono::milliseconds setup_timeout)
    : impl_(std::make_unique<Impl>(rank, world, device, std::move(store), std::move(links),
                                   timeout, std::move(prefix), setup_timeout)) {}

NcclComm::~NcclComm() = default;

bool NcclComm::built() { return true; }

void NcclComm::set_timeout(std::chrono::milliseconds timeout) {
  for (auto& r : routes_.members()) r->set_timeout(timeout);
  impl_->timeout_ms_ = timeout.count();
}

void NcclComm::set_layout(int channel, int stage, std::vector<size_t> bytes) {
  for (auto& r : routes_.members()) r->set_layout(channel, stage, bytes);
  impl_->layouts_[{channel, stage}] = std::move(bytes);
}

void NcclComm::set_names(int peer, int channel, bool send, std::vector<std::string> names) {
  for (auto& r : routes_.members()) r->set_names(peer, channel, send, names);
  impl_->names_[{peer, channel, send}] = std::move(names);
}

void NcclComm::reserve(const std::vector<staging::TransferCount>& transfers) {
  for (auto& r : routes_.members()) r->reserve(transfers);
  Impl& m = *impl_;
  m.check_failed();
  m.set_device();
  const staging::Reservation want = staging::reservation(m.layouts_, m.rank_, transfers);
  for (const auto& [bytes, n] : want.slots) m.pool_->reserve(bytes, n);
  m.reserve_events(want.events);
}

void NcclComm::record(bool on) {
  for (auto& r : routes_.members()) r->record(on);
  Impl& m = *impl_;
  if (m.closed_) return;
  m.set_device();
  std::lock_guard<std::mutex> lock(m.mu_);
  m.record_ = on;
  if (!on) return;
  // Anchor: an event completed "now" on the host's clock.
  if (!m.anchor_stream_)
    cuda_check(cudaStreamCreateWithFlags(&m.anchor_stream_, cudaStreamNonBlocking),
               "cudaStreamCreate");
  if (!m.anchor_) cuda_check(cudaEventCreate(&m.anchor_), "cudaEventCreate");
  cuda_check(cudaEventRecord(m.anchor_, m.anchor_stream_), "cudaEventRecord");
  cuda_check(cudaEventSynchronize(m.anchor_), "cudaEventSynchronize");
  m.anchor_time_ = Clock::now();
}

void NcclComm::run_group(void* stream_ptr, const std::vector<CommOp>& ops,
                         const std::vector<ConstBytes>& sends, const std::vector<MutBytes>& outs) {
  Impl& m = *impl_;
  m.check_failed();
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  size_t in = 0, out = 0;
  try {
    m.set_device();
    m.reap(false);
    for (const CommOp& op : ops) {
      if (op.peer < 0 || op.peer >= m.world_)  // (the rank itself: a self link)
        throw ExecutionError(
            fmt::format("rank {}: internal: transfer peer {} out of range", m.rank_, op.peer),
            m.rank_);
      switch (op.kind) {
        case CommOpKind::Send:
          m.send(stream, op, sends, in);
          break;
        case CommOpKind::Post:
          m.post(op);
          break;
        case CommOpKind::Wait:
          m.wait(stream, op, outs, out);
          break;
        default:
          throw ExecutionError(fmt::format("rank {}: internal: transfer kind {}", m.rank_,
                                           static_cast<int>(op.kind)),
                               m.rank_);
      }
    }
  } catch (const ExecutionError& e) {
    {
      std::lock_guard<std::mutex> lock(m.mu_);
      if (m.failure_) throw ExecutionError(m.failure_->second, m.failure_->first);
    }
    m.fail(e.what(), e.failed_rank >= 0 ? e.failed_rank : m.rank_);
  } catch (const std::exception& e) {
    m.fail(fmt::format("rank {}: {}", m.rank_, e.what()), m.rank_);
  }
  if (in != sends.size() || out != outs.size())
    m.fail(fmt::format("rank {}: internal: a transfer group used {} of {} inputs and {} of {} "
                       "results",
                       m.rank_, in, sends.size(), out, outs.size()),
           m.rank_);
  m.check_failed();  // the watchdog may have aborted meanwhile
}

void NcclComm::drain(void* /*stream*/) {
  Impl& m = *impl_;
  m.check_failed();
  try {
    m.set_device();
    m.reap(true);
  } catch (const ExecutionError& e) {
    {
      std::lock_guard<std::mutex> lock(m.mu_);
      if (m.failure_) throw ExecutionError(m.failure_->second, m.failure_->first);
    }
    m.fail(e.what(), e.failed_rank >= 0 ? e.failed_rank : m.rank_);
  }
  m.check_failed();
}

void NcclComm::mark(void* stream, int phase) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu_);
  if (!m.record_ || m.closed_) return;
  cudaEvent_t e = m.timed_event();
  cuda_check(cudaEventRecord(e, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  m.marks_.push_back({phase, e});
}

void NcclComm::abort(const std::string& msg, int origin) {
  impl_->abort(msg, origin >= 0 ? origin : impl_->rank_, true);
  for (auto& r : routes_.members()) r->abort(msg, origin);
}

void NcclComm::close() {
  for (auto& r : routes_.members()) r->close();
  impl_->close();
}

std::optional<std::pair<int, std::string>> NcclComm::failure() const {
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (impl_->failure_) return impl_->failure_;
  }
  for (auto& r : routes_.members())
    if (auto f = r->failure()) return f;
  return std::nullopt;
}

std::vector<std::pair<int, Clock::time_point>> NcclComm::take_marks() {
  Impl& m = *impl_;
  if (!m.closed_) cudaSetDevice(m.device_);
  std::lock_guard<std::mutex> lock(m.mu_);
  std::vector<std::pair<int, Clock::time_point>> out;
  out.reserve(m.marks_.size());
  for (const Impl::TimedMark& t : m.marks_) {
    out.emplace_back(t.phase, m.host_time(t.ev));
    m.timed_free_.push_back(t.ev);
  }
  m.marks_.clear();
  return out;
}

std::vector<CommEvent> NcclComm::take_events() {
  Impl& m = *impl_;
  if (!m.closed_) cudaSetDevice(m.device_);
  std::lock_guard<std::mutex> lock(m.mu_);
  for (const Impl::Timed& t : m.timed_) {
    if (t.event < m.events_.size()) {
      m.events_[t.event].started = m.host_time(t.start);
      m.events_[t.event].completed = m.host_time(t.end);
    }
    m.timed_free_.push_back(t.start);
    m.timed_free_.push_back(t.end);
  }
  m.timed_.clear();
  return std::move(m.events_);
}

std::pair<uint64_t, uint64_t> NcclComm::counts() const {
  std::pair<uint64_t, uint64_t> n{impl_->sent_.load(), impl_->received_.load()};
  for (auto& r : routes_.members()) {
    const auto [a, b] = r->counts();
    n.first += a;
    n.second += b;
  }
  return n;
}
int NcclComm::rank() const { return impl_->rank_; }
int NcclComm::world_size() const { return impl_->world_; }
int NcclComm::device() const { return impl_->device_; }
bool NcclComm::alive() const {
  if (impl_->closed_ || impl_->gone_.done()) return false;
  for (auto& r : routes_.members())
    if (!r->alive()) return false;
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return !impl_->failure_;
}
std::vector<NcclLink> NcclComm::links() const { return impl_->links_in_; }
size_t NcclComm::slots_allocated() const {
  size_t n = impl_->pool_ ? impl_->pool_->allocations() : 0;
  for (auto& r : routes_.members()) n += r->slots_allocated();
  return n;
}

size_t NcclComm::events_created() const {
  size_t n = impl_->events_created_.load();
  for (auto& r : routes_.members()) n += r->events_created();
  return n;
}

}  // namespace baton::runtime
