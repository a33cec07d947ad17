// NcclComm::Impl's transfers on the XLA thread: SEND (staged, then ncclSend on
// the link's stream), POST (ncclRecv into a slot), WAIT (the compute stream
// waits, then copies out), self links, and reaping completed sends.
#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "nccl_comm_impl.h"

namespace baton::runtime {

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
        auto lock = comms_lock();
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

std::unique_lock<std::mutex> NcclComm::Impl::comms_lock() {
  std::unique_lock<std::mutex> lock(nccl_mu_);
  if (gone_.done()) {  // aborted or closed meanwhile
    check_failed();
    throw ExecutionError(fmt::format("rank {}: the NCCL communicators are gone", rank_), rank_);
  }
  return lock;
}

void NcclComm::Impl::check_failed() const {
  if (closed_)
    throw ExecutionError(fmt::format("rank {}: the NCCL context is closed", rank_), rank_);
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

void NcclComm::Impl::reserve(const staging::Reservation& want) {
  check_failed();
  set_device();
  // Both directions share the slots of a size; a failure names the direction(s)
  // of the size that did not fit.
  for (const auto& [bytes, n] : want.slots) {
    try {
      pool_->reserve(bytes, n);
    } catch (const std::exception& e) {
      throw ExecutionError(staging::reserve_failure(rank_, bytes, want, e.what()), rank_);
    }
  }
  reserve_events(want.events);
  reserved_ = staging::merged(reserved_, want);  // (programs that share this context)
  pool_->cap(true);
}

void* NcclComm::Impl::slot(size_t bytes, bool send, const std::string& what) {
  const auto wait = std::chrono::milliseconds(timeout_ms_.load());
  const auto start = Clock::now();
  void* p = pool_->take_within(
      bytes,
      [this] {
        check_failed();
        reap(false);
      },
      start + wait);
  if (p || bytes == 0) return p;
  throw ExecutionError(
      staging::beyond_reservation(rank_, send, bytes, what, pool_->count(bytes), reserved_,
                                  std::chrono::duration<double>(Clock::now() - start).count()),
      rank_);
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
  p.slot = slot(total, true, p.what);
  // XLA's buffer -> slot on the compute stream; the send stream waits for it.
  for (size_t i = 0; i < sizes.size(); ++i, ++in)
    if (sizes[i])
      cuda_check(cudaMemcpyAsync(static_cast<char*>(p.slot) + offs[i], sends[in].data, sizes[i],
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (send staging)");
  cudaEvent_t copied = fast_event();
  cuda_check(cudaEventRecord(copied, stream), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(l.stream, copied, 0), "cudaStreamWaitEvent");
  give_fast(copied);       // the wait above captured it: free to re-record
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
      auto lock = comms_lock();
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
  p.slot = slot(total, false, p.what);
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
      auto lock = comms_lock();
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

}  // namespace baton::runtime
