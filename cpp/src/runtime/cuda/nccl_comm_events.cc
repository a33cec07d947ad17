// NcclComm::Impl's CUDA events: the pool of untimed events the transfers
// record (reused once the watchdog is done with them), and the timed events of
// recording, converted to host times against an anchor.
#include <fmt/format.h>

#include <cstdint>

#include "nccl_comm_impl.h"

namespace baton::runtime {

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

}  // namespace baton::runtime
