// DeviceSlots (slots.h): the ordinal -> slot map of a rank's devices.
#include "baton/slots.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/runtime.h"

namespace baton::runtime {

DeviceSlots::DeviceSlots(int rank, std::vector<int> ordinals) : rank_(rank) {
  if (ordinals.size() > static_cast<size_t>(kMaxSlots))
    throw ConfigError(fmt::format("rank {}: {} device slots, at most {} are supported", rank,
                                  ordinals.size(), kMaxSlots));
  for (size_t i = 0; i < ordinals.size(); ++i) {
    if (ordinals[i] < 0)
      throw ConfigError(
          fmt::format("rank {}: slot {} has device ordinal {} (< 0)", rank, i, ordinals[i]));
    for (size_t j = 0; j < i; ++j)
      if (ordinals[j] == ordinals[i])
        throw ConfigError(fmt::format("rank {}: device ordinal {} is given to slots {} and {}",
                                      rank, ordinals[i], j, i));
  }
  ordinals_ = std::move(ordinals);
}

int DeviceSlots::slot_of(int ordinal) const {
  if (ordinals_.empty()) return 0;
  for (size_t i = 0; i < ordinals_.size(); ++i)
    if (ordinals_[i] == ordinal) return static_cast<int>(i);
  throw ExecutionError(
      fmt::format("rank {}: a transfer ran on device ordinal {}, which is not one of this rank's "
                  "devices {}",
                  rank_, ordinal, fmt::join(ordinals_, ", ")),
      rank_);
}

void throw_bad_route(int rank, int ordinal) {
  throw ConfigError(fmt::format("rank {}: route of device ordinal {} (< 0)", rank, ordinal));
}

}  // namespace baton::runtime
