// Host-side parts of NcclComm (nccl_comm.h) that need no CUDA: link ordering,
// slot packing, the staging pool's bookkeeping, the registry; and NcclComm
// itself when Baton is built without CUDA/NCCL (every constructor throws).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <thread>

#include "baton/nccl_comm.h"

namespace baton::runtime {

namespace staging {

std::vector<LinkKey> canonical_links(int rank, int world, const std::vector<NcclLink>& links) {
  std::vector<LinkKey> out;
  out.reserve(links.size());
  for (const NcclLink& l : links) {
    if (l.peer < 0 || l.peer >= world)
      throw ConfigError(fmt::format("NCCL link of rank {}: peer {} is invalid (world size {})",
                                    rank, l.peer, world));
    if (l.channel < 0)
      throw ConfigError(fmt::format("NCCL link of rank {}: channel {} is negative", rank,
                                    l.channel));
    out.push_back(l.send ? LinkKey{rank, l.peer, l.channel} : LinkKey{l.peer, rank, l.channel});
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void check_arguments(int rank, int world, bool has_store, const std::vector<NcclLink>& links) {
  if (!has_store) throw ConfigError("NcclRankComm: a rendezvous store is required");
  if (world < 1 || rank < 0 || rank >= world)
    throw ConfigError(
        fmt::format("NcclRankComm: rank {} is invalid for world size {}", rank, world));
  (void)canonical_links(rank, world, links);
}

std::vector<size_t> packed_offsets(const std::vector<size_t>& bytes, size_t align) {
  if (align == 0) align = 1;
  std::vector<size_t> out;
  out.reserve(bytes.size() + 1);
  size_t at = 0;
  for (size_t n : bytes) {
    at = (at + align - 1) / align * align;
    out.push_back(at);
    at += n;
  }
  out.push_back(at);
  return out;
}

SlotPool::SlotPool(Alloc alloc, Free free, Ready ready, Release release)
    : alloc_(std::move(alloc)),
      free_(std::move(free)),
      ready_(std::move(ready)),
      release_(std::move(release)) {}

SlotPool::~SlotPool() {
  for (const Retired& r : retired_) {
    if (r.fence) release_(r.fence);
    free_(r.buf);
  }
  for (auto& [n, list] : free_lists_)
    for (void* p : list) free_(p);
}

size_t SlotPool::reclaim() {
  size_t n = 0;
  // Fences complete roughly in order; test all (a few per step).
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (it->fence == nullptr || ready_(it->fence)) {
      if (it->fence) release_(it->fence);
      free_lists_[it->bytes].push_back(it->buf);
      it = retired_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

void* SlotPool::take(size_t bytes) {
  if (bytes == 0) return nullptr;
  auto it = free_lists_.find(bytes);
  if (it == free_lists_.end() || it->second.empty()) {
    reclaim();
    it = free_lists_.find(bytes);
  }
  if (it != free_lists_.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  void* p = alloc_(bytes);
  ++allocations_;
  ++allocated_[bytes];
  return p;
}

size_t SlotPool::reserve(size_t bytes, size_t n) {
  if (bytes == 0) return 0;
  size_t made = 0;
  for (size_t& have = allocated_[bytes]; have < n; ++have, ++made) {
    free_lists_[bytes].push_back(alloc_(bytes));
    ++allocations_;
  }
  return made;
}

void SlotPool::retire(void* buf, size_t bytes, void* fence) {
  if (buf == nullptr) {
    if (fence) release_(fence);
    return;
  }
  if (fence == nullptr) {
    free_lists_[bytes].push_back(buf);
    return;
  }
  retired_.push_back({buf, bytes, fence});
}

size_t SlotPool::free_count() const {
  size_t n = 0;
  for (const auto& [b, list] : free_lists_) n += list.size();
  return n;
}

Reservation reservation(const CommLayouts& layouts, int rank,
                        const std::vector<TransferCount>& transfers) {
  Reservation r;
  for (const TransferCount& t : transfers) {
    if (t.count < 0)
      throw ConfigError(fmt::format("rank {}: reserve: {} transfers of the {} buffer of stage {}",
                                    rank, t.count, comm_channel_name(t.channel), t.stage));
    const size_t bytes = packed_offsets(comm_layout(layouts, rank, t.channel, t.stage)).back();
    const auto n = static_cast<size_t>(t.count);
    if (bytes) r.slots[bytes] += n;
    r.events += (t.send ? 2 : 3) * n;
  }
  return r;
}

}  // namespace staging

// ---------------------------------------------------------------- device slots

void NcclComm::set_route(int ordinal, std::shared_ptr<NcclComm> member) {
  if (member.get() == this)
    throw ConfigError(fmt::format("rank {}: a context routed to itself (device ordinal {})",
                                  rank(), ordinal));
  routes_.set(rank(), ordinal, std::move(member));
}

NcclComm& NcclComm::route(int ordinal) {
  if (auto m = routes_.find(ordinal)) return *m;
  // No routes: one slot, any ordinal (as DeviceSlots with no ordinals; a one-device rank).
  if (ordinal == device() || routes_.empty()) return *this;
  throw ExecutionError(
      fmt::format("rank {}: a transfer ran on CUDA device {}, but this rank's NCCL contexts are "
                  "on device {}{}{} (one context per device slot: NcclRankComm.set_route)",
                  rank(), ordinal, device(), routes_.empty() ? "" : " and ",
                  fmt::join(routes_.ordinals(), ", ")),
      rank());
}

// ---------------------------------------------------------------- registry

namespace {
CommRegistry<NcclComm>& nccl_registry() {
  // never destroyed; ids apart from register_comm's
  static auto* r = new CommRegistry<NcclComm>(int64_t{1} << 40);
  return *r;
}

// Every context ever registered (weakly: the registry and Python own them), for close_all.
struct Made {
  std::mutex mu;
  std::vector<std::weak_ptr<NcclComm>> comms;
};
Made& made() {
  static auto* m = new Made;  // never destroyed (used at exit)
  return *m;
}
}  // namespace

namespace staging {
void run_concurrently(const std::vector<std::function<void()>>& jobs) {
  std::vector<std::thread> threads;
  threads.reserve(jobs.size());
  for (const auto& job : jobs)
    threads.emplace_back([&job] {
      try {
        job();
      } catch (...) {  // a close never throws out of here (at exit, nothing could catch it)
      }
    });
  for (std::thread& t : threads) t.join();
}
}  // namespace staging

int64_t register_nccl_comm(std::shared_ptr<NcclComm> comm) {
  if (comm) {
    std::lock_guard<std::mutex> lock(made().mu);
    auto& v = made().comms;
    std::erase_if(v, [](const std::weak_ptr<NcclComm>& w) { return w.expired(); });
    v.push_back(comm);
  }
  return nccl_registry().add(std::move(comm));
}

size_t close_all_nccl_comms() {
  std::vector<std::shared_ptr<NcclComm>> live;
  {
    std::lock_guard<std::mutex> lock(made().mu);
    for (const auto& w : made().comms)
      if (auto c = w.lock()) live.push_back(std::move(c));
    made().comms.clear();
  }
  std::vector<std::function<void()>> jobs;
  for (const auto& c : live) jobs.push_back([c] { c->close(); });
  staging::run_concurrently(jobs);
  return live.size();
}

void unregister_nccl_comm(int64_t id) { nccl_registry().remove(id); }

std::shared_ptr<NcclComm> find_nccl_comm(int64_t id) { return nccl_registry().find(id); }

// ---------------------------------------------------------------- no CUDA build

#if !defined(BATON_HAVE_NCCL)
struct NcclComm::Impl {};

NcclComm::NcclComm(int rank, int world, int, std::shared_ptr<Store> store,
                   std::vector<NcclLink> links, std::chrono::milliseconds, std::string,
                   std::chrono::milliseconds) {
  staging::check_arguments(rank, world, store != nullptr, links);
  throw ConfigError(
      "NcclComm is not available: Baton was built without CUDA/nccl.h (rebuild on a machine "
      "with the CUDA toolkit and NCCL headers)");
}
NcclComm::~NcclComm() = default;
bool NcclComm::built() { return false; }
void NcclComm::set_timeout(std::chrono::milliseconds) {}
void NcclComm::set_layout(int, int, std::vector<size_t>) {}
void NcclComm::set_names(int, int, bool, std::vector<std::string>) {}
void NcclComm::record(bool) {}
void NcclComm::reserve(const std::vector<staging::TransferCount>&) {}
void NcclComm::run_group(void*, const std::vector<CommOp>&, const std::vector<ConstBytes>&,
                         const std::vector<MutBytes>&) {
  throw ExecutionError("NcclComm: built without CUDA");
}
void NcclComm::drain(void*) {}
void NcclComm::mark(void*, int) {}
void NcclComm::abort(const std::string&, int) {}
void NcclComm::close() {}
std::optional<std::pair<int, std::string>> NcclComm::failure() const { return std::nullopt; }
std::vector<std::pair<int, Clock::time_point>> NcclComm::take_marks() { return {}; }
std::vector<CommEvent> NcclComm::take_events() { return {}; }
std::pair<uint64_t, uint64_t> NcclComm::counts() const { return {0, 0}; }
int NcclComm::rank() const { return -1; }
int NcclComm::world_size() const { return 0; }
int NcclComm::device() const { return -1; }
bool NcclComm::alive() const { return false; }
std::vector<NcclLink> NcclComm::links() const { return {}; }
size_t NcclComm::slots_allocated() const { return 0; }
size_t NcclComm::events_created() const { return 0; }
#endif

}  // namespace baton::runtime
