// NcclComm: a rank program's transfers over NCCL on XLA's CUDA stream (see
// nccl_comm.h for the design: staging slots, one communicator per link and
// direction, the watchdog). Built only when CUDA and nccl.h are found.
//
// This file: NcclComm's public methods over NcclComm::Impl (nccl_comm_impl.h),
// which the nccl_comm_*.cc files implement.
#include "baton/nccl_comm.h"

#include <fmt/format.h>

#include <mutex>

#include "nccl_comm_impl.h"

namespace baton::runtime {

NcclComm::NcclComm(int rank, int world, int device, std::shared_ptr<Store> store,
                   std::vector<NcclLink> links, std::chrono::milliseconds timeout,
                   std::string prefix, std::chrono::milliseconds setup_timeout)
    : impl_(std::make_unique<Impl>(rank, world, device, std::move(store), std::move(links), timeout,
                                   std::move(prefix), setup_timeout)) {}

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

void NcclComm::reserve(const std::vector<staging::InFlight>& transfers) {
  for (auto& r : routes_.members()) r->reserve(transfers);
  impl_->reserve(staging::reservation(impl_->layouts_, impl_->rank_, transfers));
}

void NcclComm::reserve(const std::vector<staging::TransferCount>& transfers) {
  for (auto& r : routes_.members()) r->reserve(transfers);
  impl_->reserve(staging::reservation(impl_->layouts_, impl_->rank_, transfers));
}

std::pair<size_t, size_t> NcclComm::reserved_bytes() const {
  std::pair<size_t, size_t> b{impl_->reserved_.send_bytes, impl_->reserved_.recv_bytes};
  for (auto& r : routes_.members()) {
    const auto [s, v] = r->reserved_bytes();
    b.first += s;
    b.second += v;
  }
  return b;
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
