// NcclComm::Impl's failures: abort (communicators aborted, the failure
// published in the store) and the watchdog thread, which bounds waited-for
// receives and watches NCCL async errors and other ranks' failures.
#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "../wire.h"
#include "nccl_comm_impl.h"

namespace baton::runtime {

void NcclComm::Impl::abort_comms() {
  // gone_ is set under nccl_mu_ (after any NCCL call in flight), so no new call
  // starts; ncclCommAbort then runs with the lock released: the XLA thread, which
  // takes nccl_mu_ for its NCCL calls, never waits behind an abort.
  if (!gone_.first_under(nccl_mu_)) return;
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
      timed_out = fmt::format(
          "rank {}: timed out after {:g} s receiving {} (the compute "
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

}  // namespace baton::runtime
