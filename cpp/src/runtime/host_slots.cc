#include "baton/host_slots.h"

#include <fmt/format.h>

#include <cstring>
#include <stdexcept>

namespace baton::runtime {

void HostSlots::put(int shard, int32_t slot, const void* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Slot& s = slots_[{shard, slot}];
  if (s.held)
    throw std::runtime_error(
        fmt::format("OFFLOAD into host slot {} (shard {}), which still holds a buffer not fetched",
                    slot, shard));
  s.data.resize(bytes);
  if (bytes) std::memcpy(s.data.data(), data, bytes);
  s.held = true;
  held_ += bytes;
  if (held_ > peak_) peak_ = held_;
}

void HostSlots::take(int shard, int32_t slot, void* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find({shard, slot});
  if (it == slots_.end() || !it->second.held)
    throw std::runtime_error(
        fmt::format("FETCH from host slot {} (shard {}), which holds no buffer", slot, shard));
  Slot& s = it->second;
  if (s.data.size() != bytes)
    throw std::runtime_error(
        fmt::format("FETCH of {} bytes from host slot {} (shard {}), which holds {} bytes", bytes,
                    slot, shard, s.data.size()));
  if (bytes) std::memcpy(data, s.data.data(), bytes);
  s.held = false;
  held_ -= bytes;
}

size_t HostSlots::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

size_t HostSlots::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void HostSlots::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = held_;
}

}  // namespace baton::runtime
