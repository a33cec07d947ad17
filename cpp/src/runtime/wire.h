// Internal (not installed): the decoders of bytes a process receives from its
// peers, kept apart from the transports so that each can be tested and fuzzed
// on its own (cpp/fuzz/). Every decoder checks what it reads and throws
// ExecutionError naming the peer; none allocates more than its input implies.
//   - the transfer header of a Gloo send without a known layout (meta text:
//     tensor count, then per tensor a dtype code, a rank and the dimensions);
//   - the address blob a rank publishes in the store during Gloo start-up
//     (per peer: a 4-byte little-endian length, then that many bytes);
//   - a Gloo control message (abort / bye) and the NCCL abort note
//     ("<origin>|<reason>") a failing rank leaves in the store.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "baton/runtime.h"

namespace baton::runtime::wire {

// Transfer headers are a few bytes per tensor; anything longer is refused
// before it is allocated.
constexpr uint64_t kMaxMetaBytes = uint64_t{1} << 20;
// One tensor received without a known layout may not claim more than this.
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 40;

std::string encode_meta(const Layout& layout);
// Throws ExecutionError (naming `peer`) when `len` exceeds kMaxMetaBytes.
void check_meta_len(uint64_t len, int peer);
// The layout a header describes; throws ExecutionError naming `peer` for a
// malformed header, an unknown dtype, a negative dimension or a tensor over
// kMaxTensorBytes.
Layout decode_meta(std::string_view meta, int peer);

// The address blob `reader`'s peer `publisher` published (world size
// `world`): the bytes of publisher's pair for `reader`.
std::string encode_addresses(const std::vector<std::vector<char>>& per_peer);
std::vector<char> address_for(std::string_view blob, int publisher, int reader, int world);

// A Gloo control message, as it travels (fixed size).
constexpr uint32_t kMsgAbort = 1, kMsgBye = 2, kMsgBeat = 3;
struct ControlMsg {
  uint32_t kind = 0;
  int32_t origin = -1;
  char text[1016] = {};
};
static_assert(sizeof(ControlMsg) == 1024);

struct Control {
  uint32_t kind = 0;  // kMsgAbort, kMsgBye, kMsgBeat or anything else (ignored)
  int origin = -1;    // in [0, world); a peer's out-of-range origin becomes `peer`
  std::string text;   // at most sizeof(ControlMsg::text) - 1 bytes
};
Control decode_control(const ControlMsg& m, int peer, int world);

// The NCCL abort note "<origin>|<reason>" read from the store; an origin that
// is not a rank in [0, world) becomes -1 (unknown), a note without '|' is
// all reason.
struct AbortNote {
  int origin = -1;
  std::string reason;
};
std::string encode_abort_note(int origin, std::string_view reason);
AbortNote decode_abort_note(std::string_view note, int world);

}  // namespace baton::runtime::wire
