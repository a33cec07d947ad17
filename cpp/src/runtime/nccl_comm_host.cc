// Host-side parts of NcclComm (nccl_comm.h) that need no CUDA: link ordering,
// slot packing, the staging pool's bookkeeping, the registry; and NcclComm
// itself when Baton is built without CUDA/NCCL (every constructor throws).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
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
      throw ConfigError(
          fmt::format("NCCL link of rank {}: channel {} is negative", rank, l.channel));
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

size_t SlotPool::count(size_t bytes) const {
  auto it = allocated_.find(bytes);
  return it == allocated_.end() ? 0 : it->second;
}

void* SlotPool::take_within(size_t bytes, const std::function<void()>& poll,
                            std::chrono::steady_clock::time_point deadline) {
  if (void* p = take(bytes); p || bytes == 0 || !capped_) return p;
  if (count(bytes) == 0) return nullptr;  // none of this size: none will come free
  for (int spins = 0;; ++spins) {
    if (poll) poll();
    reclaim();
    auto it = free_lists_.find(bytes);
    if (it != free_lists_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      return p;
    }
    if (std::chrono::steady_clock::now() >= deadline) return nullptr;
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 10 : 200));
  }
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
  if (capped_) return nullptr;
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
                        const std::vector<InFlight>& transfers) {
  // Per (direction, packed bytes): +1 at a transfer's first instruction, -1 after
  // its last; the most at once is the running sum's maximum (releases at a
  // position before acquisitions there: [0, 3] and [4, 5] never overlap).
  constexpr int kEnd = std::numeric_limits<int>::max();
  std::map<std::pair<bool, size_t>, std::vector<std::pair<int, int>>> points;
  std::map<bool, std::vector<std::pair<int, int>>> all;  // every size: events
  for (const InFlight& t : transfers) {
    const int to = t.to < 0 ? kEnd - 1 : t.to;
    if (t.from < 0 || to < t.from)
      throw ConfigError(fmt::format(
          "rank {}: reserve: a {} of the {} buffer of stage {} is in flight from instruction {} "
          "to {}",
          rank, t.send ? "send" : "receive", comm_channel_name(t.channel), t.stage, t.from, t.to));
    const size_t bytes = packed_offsets(comm_layout(layouts, rank, t.channel, t.stage)).back();
    for (auto* v : {&points[{t.send, bytes}], &all[t.send]}) {
      v->push_back({t.from, +1});
      v->push_back({to + 1, -1});
    }
  }
  auto most = [](std::vector<std::pair<int, int>>& v) {
    std::sort(v.begin(), v.end());  // (-1 before +1 at one position)
    size_t at = 0, top = 0;
    for (const auto& [pos, d] : v) {
      at = d > 0 ? at + 1 : at - 1;
      top = std::max(top, at);
    }
    return top;
  };
  Reservation r;
  for (auto& [key, v] : points) {
    const auto [send, bytes] = key;
    const size_t n = most(v);
    if (bytes == 0) continue;
    r.slots[bytes] += n;
    if (send) r.send_slots[bytes] += n;
    (send ? r.send_bytes : r.recv_bytes) += n * bytes;
  }
  for (auto& [send, v] : all) r.events += (send ? 2 : 3) * most(v);
  return r;
}

Reservation reservation(const CommLayouts& layouts, int rank,
                        const std::vector<TransferCount>& transfers) {
  std::vector<InFlight> all;
  for (const TransferCount& t : transfers) {
    if (t.count < 0)
      throw ConfigError(fmt::format("rank {}: reserve: {} transfers of the {} buffer of stage {}",
                                    rank, t.count, comm_channel_name(t.channel), t.stage));
    for (int i = 0; i < t.count; ++i) all.push_back({t.channel, t.stage, t.send, 0, 0});
  }
  return reservation(layouts, rank, all);
}

Reservation merged(const Reservation& a, const Reservation& b) {
  auto get = [](const std::map<size_t, size_t>& m, size_t k) {
    auto it = m.find(k);
    return it == m.end() ? size_t{0} : it->second;
  };
  Reservation r;
  r.events = std::max(a.events, b.events);
  for (const Reservation* x : {&a, &b})
    for (const auto& [bytes, n] : x->slots) {
      const size_t sends = std::max(get(a.send_slots, bytes), get(b.send_slots, bytes));
      const size_t recvs = std::max(get(a.slots, bytes) - get(a.send_slots, bytes),
                                    get(b.slots, bytes) - get(b.send_slots, bytes));
      r.slots[bytes] = sends + recvs;
      if (sends) r.send_slots[bytes] = sends;
    }
  for (const auto& [bytes, n] : r.slots) {
    const size_t sends = get(r.send_slots, bytes);
    r.send_bytes += sends * bytes;
    r.recv_bytes += (n - sends) * bytes;
  }
  return r;
}

std::string bytes_text(size_t bytes) {
  const double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
  if (mib >= 1024.0) return fmt::format("{:.2f} GiB ({} bytes)", mib / 1024.0, bytes);
  return fmt::format("{:.2f} MiB ({} bytes)", mib, bytes);
}

std::string reserve_failure(int rank, size_t slot_bytes, const Reservation& r,
                            const std::string& why) {
  auto get = [&](const std::map<size_t, size_t>& m) {
    auto it = m.find(slot_bytes);
    return it == m.end() ? size_t{0} : it->second;
  };
  const size_t slots = get(r.slots), sends = get(r.send_slots), recvs = slots - sends;
  const std::string dir = sends == 0   ? "receives"
                          : recvs == 0 ? "sends"
                                       : fmt::format("sends ({}) and receives ({})", sends, recvs);
  return fmt::format(
      "rank {}: cannot reserve staging for {}: {} slot{} of {}, {} in all ({} for sends, {} for "
      "receives: the most in flight at once): {}",
      rank, dir, slots, slots == 1 ? "" : "s", bytes_text(slot_bytes),
      bytes_text(slots * slot_bytes), bytes_text(r.send_bytes), bytes_text(r.recv_bytes), why);
}

std::string beyond_reservation(int rank, bool send, size_t bytes, const std::string& what,
                               size_t reserved, const Reservation& r, double waited_s) {
  return fmt::format(
      "rank {}: a {} ({}) needs {} of staging beyond the reservation: {} slot{} of that size "
      "reserved, {} held after waiting {:g} s ({} reserved for sends, {} for receives: the most "
      "in flight at once in the rank program; more in flight than it says)",
      rank, send ? "send" : "receive", what, bytes_text(bytes), reserved, reserved == 1 ? "" : "s",
      reserved == 0 ? "none" : "all", waited_s, bytes_text(r.send_bytes), bytes_text(r.recv_bytes));
}

}  // namespace staging

// ---------------------------------------------------------------- device slots

void NcclComm::set_route(int ordinal, std::shared_ptr<NcclComm> member) {
  if (member.get() == this)
    throw ConfigError(
        fmt::format("rank {}: a context routed to itself (device ordinal {})", rank(), ordinal));
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
void NcclComm::reserve(const std::vector<staging::InFlight>&) {}
void NcclComm::reserve(const std::vector<staging::TransferCount>&) {}
std::pair<size_t, size_t> NcclComm::reserved_bytes() const { return {0, 0}; }
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
