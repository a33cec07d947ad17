// Host memory of a rank program's offloaded buffers (OFFLOAD / FETCH in
// rank_program.h), held by the C++ runtime for the XLA FFI handlers
// baton_offload / baton_fetch (cpp/python/ffi_handlers.cc).
//
// A slot is one of the rank program's host slots (per shard: each device of a
// rank offloads its own shard). OFFLOAD copies the buffer's bytes into its
// slot; FETCH copies them back out and releases the slot (its bytes stay
// allocated for the next buffer of that slot, but no longer count as held).
// The rank IR's verifier guarantees a slot is fetched after its offload and
// never reused while held; the checks here turn a violation into an error
// naming the slot instead of wrong data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace baton::runtime {

class HostSlots {
 public:
  // OFFLOAD: `bytes` bytes at `data` into (shard, slot). Throws std::runtime_error
  // when the slot already holds a buffer.
  void put(int shard, int32_t slot, const void* data, size_t bytes);
  // FETCH: the bytes of (shard, slot) into `data` (`bytes` of them), releasing the
  // slot. Throws when it holds nothing or a buffer of another size.
  void take(int shard, int32_t slot, void* data, size_t bytes);
  // Bytes held now, and the most held at once since the last reset_peak.
  size_t held_bytes() const;
  size_t peak_bytes() const;
  void reset_peak();

 private:
  struct Slot {
    std::vector<std::byte> data;  // capacity kept between buffers
    bool held = false;
  };
  mutable std::mutex mu_;
  std::map<std::pair<int, int32_t>, Slot> slots_;
  size_t held_ = 0;
  size_t peak_ = 0;
};

}  // namespace baton::runtime
