// Host-staged transfers (host_staged.h): the ordering of staging copies
// against XLA's stream and the RankComm operations between them.
#include "baton/host_staged.h"

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "baton/runtime.h"

namespace baton::runtime {

CudaTransportChoice choose_cuda_transport(const std::vector<std::string>& hosts,
                                          const std::vector<int>& ordinals, bool nccl_available,
                                          const std::string& nccl_error) {
  if (hosts.size() != ordinals.size())
    throw std::invalid_argument(fmt::format(
        "choose_cuda_transport: {} hosts for {} ranks' device ordinals", hosts.size(),
        ordinals.size()));
  std::map<std::pair<std::string, int>, int> first;  // (host, ordinal) -> first rank on it
  for (size_t r = 0; r < ordinals.size(); ++r) {
    if (ordinals[r] < 0)
      throw std::invalid_argument(
          fmt::format("choose_cuda_transport: rank {} has device ordinal {}", r, ordinals[r]));
    auto [it, fresh] = first.emplace(std::make_pair(hosts[r], ordinals[r]), static_cast<int>(r));
    if (!fresh)
      return {CudaTransport::HostStaged,
              fmt::format("baton: ranks {} and {} share GPU {} on {}: transfers are staged "
                          "through pinned host memory over Gloo (NCCL needs one GPU per rank)",
                          it->second, r, ordinals[r], hosts[r])};
  }
  if (!nccl_available)
    return {CudaTransport::HostStaged,
            fmt::format("baton: NCCL unavailable ({}): transfers are staged through pinned host "
                        "memory over Gloo",
                        nccl_error.empty() ? std::string("no reason given") : nccl_error)};
  return {CudaTransport::Nccl, {}};
}

namespace {
struct StagedRegistry {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<HostStagedComm>> map;
};
StagedRegistry& staged_registry() {
  static StagedRegistry r;
  return r;
}
}  // namespace

void register_staged_comm(int64_t id, std::shared_ptr<HostStagedComm> comm) {
  auto& r = staged_registry();
  std::shared_ptr<HostStagedComm> gone;  // destroyed outside the lock
  std::lock_guard<std::mutex> g(r.mu);
  auto& slot = r.map[id];
  gone = std::move(slot);
  slot = std::move(comm);
}

void unregister_staged_comm(int64_t id) {
  auto& r = staged_registry();
  std::shared_ptr<HostStagedComm> gone;
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.map.find(id);
  if (it == r.map.end()) return;
  gone = std::move(it->second);
  r.map.erase(it);
}

std::shared_ptr<HostStagedComm> find_staged_comm(int64_t id) {
  auto& r = staged_registry();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.map.find(id);
  return it == r.map.end() ? nullptr : it->second;
}

HostStagedComm::HostStagedComm(std::shared_ptr<RankComm> comm,
                               std::unique_ptr<StagingDevice> device)
    : comm_(std::move(comm)), dev_(std::move(device)) {
  if (!comm_ || !dev_) throw std::invalid_argument("HostStagedComm: null comm or device");
  produced_ = dev_->create_event();
  copied_ = dev_->create_event();
}

HostStagedComm::~HostStagedComm() {
  if (pinned_) dev_->free_pinned(pinned_);
  dev_->destroy_event(copied_);
  dev_->destroy_event(produced_);
}

void HostStagedComm::ensure(size_t bytes) {
  if (bytes <= capacity_) return;
  if (pinned_) dev_->free_pinned(pinned_);
  pinned_ = nullptr;
  capacity_ = 0;
  pinned_ = dev_->alloc_pinned(bytes);
  capacity_ = bytes;
}

void HostStagedComm::run_group(const std::vector<CommOp>& ops,
                               const std::vector<ConstBytes>& sends,
                               const std::vector<MutBytes>& outs,
                               StagingDevice::Stream xla_stream, int shard) {
  size_t send_bytes = 0, out_bytes = 0;
  for (const auto& b : sends) send_bytes += b.size;
  for (const auto& b : outs) out_bytes += b.size;
  ensure(send_bytes + out_bytes);
  auto* base = static_cast<unsigned char*>(pinned_);
  const StagingDevice::Stream cs = dev_->copy_stream();

  // Sends: their tensors are complete once the work XLA enqueued so far is.
  std::vector<ConstBytes> host_sends;
  host_sends.reserve(sends.size());
  if (!sends.empty()) {
    dev_->record(produced_, xla_stream);
    dev_->wait(cs, produced_);
    size_t at = 0;
    for (const auto& b : sends) {
      if (b.size) dev_->copy_d2h(base + at, b.data, b.size, cs);
      host_sends.push_back({base + at, b.size});
      at += b.size;
    }
    dev_->record(copied_, cs);
    dev_->sync(copied_);  // the host bytes are complete before RankComm reads them
  }
  std::vector<MutBytes> host_outs;
  host_outs.reserve(outs.size());
  size_t at = send_bytes;
  for (const auto& b : outs) {
    host_outs.push_back({base + at, b.size});
    at += b.size;
  }
  // RankComm copies send bytes before returning and returns after every WAIT's
  // bytes are in host_outs.
  comm_->run_group(ops, host_sends, host_outs, shard);
  if (!outs.empty()) {
    for (size_t i = 0; i < outs.size(); ++i)
      if (outs[i].size) dev_->copy_h2d(outs[i].data, host_outs[i].data, outs[i].size, cs);
    dev_->record(copied_, cs);
    dev_->wait(xla_stream, copied_);
    // The pinned bytes are reused by the next group: they must be read first.
    dev_->sync(copied_);
  }
}

}  // namespace baton::runtime
