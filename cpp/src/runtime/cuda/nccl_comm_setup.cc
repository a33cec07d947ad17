// NcclComm::Impl setup and teardown: the communicators of every link created
// and connected under the setup deadline (aborted with an error naming the
// peer when it passes), and close(), which destroys or aborts them.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "baton/cuda_env.h"
#include "baton/nccl_library.h"
#include "nccl_comm_impl.h"

namespace baton::runtime {

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
  staging::check_arguments(rank, world, store_ != nullptr, links_in_);
  const std::vector<LinkKey> keys = staging::canonical_links(rank, world, links_in_);
  if (const std::string p = cuda_env::max_connections_problem(
          std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"));
      !p.empty())
    throw ConfigError("NcclRankComm: " + p);
  int count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the error state
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    const std::string old = cuda_env::driver_problem(driver, runtime);
    throw ConfigError(fmt::format(
        "NcclRankComm needs a CUDA device, and there is none{}{}",
        ce != cudaSuccess ? fmt::format(" (cudaGetDeviceCount: {})", cudaGetErrorString(ce)) : "",
        old.empty() ? "" : ": " + old));
  }
  if (device < 0 || device >= count)
    throw ConfigError(
        fmt::format("NcclRankComm: CUDA device {} does not exist ({} visible)", device, count));
  const auto& api = nccl_api();
  if (!api.lib) throw ConfigError(fmt::format("NcclRankComm: cannot load NCCL: {}", api.error));
  // Checked at every construction: JAX's CUDA plugin may have mapped its own copy since.
  if (const std::string p = cuda_env::second_nccl_problem(nccl_library::mapped("libnccl"), api.path);
      !p.empty())
    throw ConfigError("NcclRankComm: " + p);
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
    store_->set(id_key(keys[i]),
                std::string(reinterpret_cast<const char*>(&ids[i]), sizeof(ncclUniqueId)));
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
      r = k.src == rank_
              ? api.Send(warm, 1, ncclUint8, 1, l.comm, l.stream)
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
    for (auto& [k, l] : links_)  // the aborted kernels end (the 1-byte warm-up)
      if (l.stream) (void)cudaStreamSynchronize(l.stream);
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
  // Idle: ncclCommFinalize (flushes NCCL's pending work and its proxy, non-blocking:
  // polled under the deadline), then ncclCommDestroy. A finalize that fails or does
  // not end in time aborts instead.
  if (gone_.first_under(nccl_mu_)) {
    const auto& api = nccl_api();
    std::vector<ncclComm_t> comms;
    for (auto& [k, l] : links_)
      if (l.comm) comms.push_back(l.comm);
    bool finalized = true;
    try {
      for (ncclComm_t c : comms) accepted(api.CommFinalize(c), "ncclCommFinalize");
      nccl_detail::wait_ready(
          comms, Clock::now() + std::chrono::milliseconds(timeout_ms_.load()),
          [](size_t i) { return fmt::format("communicator {}", i); },
          fmt::format("rank {}: closing (ncclCommFinalize)", rank_));
    } catch (const std::exception&) {
      finalized = false;
    }
    for (ncclComm_t c : comms) finalized ? api.CommDestroy(c) : api.CommAbort(c);
  }
  // Only this context's streams are waited for (aborted NCCL kernels end), never the
  // whole device: other contexts and XLA keep running.
  for (auto& [k, l] : links_) (void)cudaStreamSynchronize(l.stream);
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

}  // namespace baton::runtime
