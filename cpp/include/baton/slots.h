// Device slots of a rank of several devices: the routing shared by the CPU
// transfer contexts (RankComm, Gloo or in-process) and the CUDA ones (NcclComm).
//
// A rank's devices are numbered in the order of its sub-mesh (slot 0, 1, ...).
// Slot j of rank a exchanges with slot j of rank b: the same block of the same
// sharding, shard to shard. XLA calls a transfer handler once per device, with
// that device's ordinal (ffi::Ctx<ffi::DeviceOrdinal>: on CPU the jax device
// id, on CUDA the device's local ordinal); the context maps the ordinal to a
// slot (DeviceSlots), and where every slot has a context of its own (NCCL: one
// communicator set per slot; ranks that share one program on CPU: one context
// per member rank) the call is routed to it (SlotRoutes).
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace baton::runtime {

// At most this many slots per rank.
inline constexpr int kMaxSlots = 256;

// Ordinal -> slot index of one rank's devices. Empty: one slot, any ordinal.
class DeviceSlots {
 public:
  DeviceSlots() = default;
  // Throws ConfigError naming `rank` for a negative or repeated ordinal, or
  // more than kMaxSlots of them.
  DeviceSlots(int rank, std::vector<int> ordinals);

  // The slot of a call from device `ordinal`: its index, or 0 when there are
  // no ordinals. Throws ExecutionError naming the rank, the ordinal and the
  // rank's devices when the ordinal is not one of them.
  int slot_of(int ordinal) const;
  int size() const { return ordinals_.empty() ? 1 : static_cast<int>(ordinals_.size()); }
  const std::vector<int>& ordinals() const { return ordinals_; }

 private:
  int rank_ = -1;
  std::vector<int> ordinals_;
};

// Ordinal -> the context that serves that device's calls (null: the caller's
// own). Set while no program runs; read concurrently by the handlers
// (thread-safe).
template <class T>
class SlotRoutes {
 public:
  // Routes `ordinal` to `member` (null removes the route). Throws ConfigError
  // naming `rank` for a negative ordinal.
  void set(int rank, int ordinal, std::shared_ptr<T> member);
  std::shared_ptr<T> find(int ordinal) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(ordinal);
    return it == map_.end() ? nullptr : it->second;
  }
  // Every routed context, by ordinal.
  std::vector<std::shared_ptr<T>> members() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<T>> out;
    for (const auto& [o, m] : map_) out.push_back(m);
    return out;
  }
  std::vector<int> ordinals() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> out;
    for (const auto& [o, m] : map_) out.push_back(o);
    return out;
  }
  bool empty() const {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.empty();
  }

 private:
  mutable std::mutex mu_;
  std::map<int, std::shared_ptr<T>> map_;
};

// The ConfigError of a negative route ordinal (slots.cc; keeps error.h out of
// this header's users' way).
[[noreturn]] void throw_bad_route(int rank, int ordinal);

template <class T>
void SlotRoutes<T>::set(int rank, int ordinal, std::shared_ptr<T> member) {
  if (ordinal < 0) throw_bad_route(rank, ordinal);
  std::lock_guard<std::mutex> lock(mu_);
  if (member)
    map_[ordinal] = std::move(member);
  else
    map_.erase(ordinal);
}

}  // namespace baton::runtime
