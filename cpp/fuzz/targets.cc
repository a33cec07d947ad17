// Fuzz entries (targets.h).
#include "targets.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../src/runtime/wire.h"
#include "baton/autoplan.h"
#include "baton/cluster.h"
#include "baton/cost.h"
#include "baton/error.h"
#include "baton/hardware.h"
#include "baton/text_format.h"

namespace baton::fuzz {

void fail(std::string_view target, std::string_view what) {
  std::fprintf(stderr, "fuzz_%.*s: %.*s\n", static_cast<int>(target.size()), target.data(),
               static_cast<int>(what.size()), what.data());
  std::abort();
}

namespace {

std::string text_of(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// Runs `f`; a baton::Error is the expected refusal of bad input.
template <class F>
void refused_or(F&& f) {
  try {
    f();
  } catch (const baton::Error&) {
  }
}

// The schedule text format (baton-plan --load, baton.load_schedule).
void schedule_text(const uint8_t* data, size_t size) {
  refused_or([&] {
    const Schedule s = load_schedule(text_of(data, size));
    const std::string again = save_schedule(s);
    if (!(load_schedule(again) == s)) fail("schedule_text", "save/load round trip differs");
  });
}

// Per-stage cost JSON (baton-plan --costs, CostModel.from_json).
void cost_json(const uint8_t* data, size_t size) {
  refused_or([&] {
    const CostModel c = CostModel::from_json(text_of(data, size));
    if (!(CostModel::from_json(c.to_json()) == c))
      fail("cost_json", "to/from JSON round trip differs");
  });
}

// Per-segment cost JSON of the automatic planner (baton-plan --segments).
void segment_json(const uint8_t* data, size_t size) {
  refused_or([&] {
    const SegmentCosts c = SegmentCosts::from_json(text_of(data, size));
    const std::string j = c.to_json();  // SegmentCosts has no ==: its JSON stands for it
    if (SegmentCosts::from_json(j).to_json() != j)
      fail("segment_json", "to/from JSON round trip differs");
  });
}

// Command-line values of baton-plan: byte sizes and remat modes.
void plan_options(const uint8_t* data, size_t size) {
  const std::string s = text_of(data, size);
  refused_or([&] {
    if (parse_bytes(s) < 0) fail("plan_options", "parse_bytes accepted a negative size");
  });
  refused_or([&] { (void)parse_remat(s); });
}

// Gloo transfer header: an 8-byte length, then the meta text, as a peer sends it.
void wire_meta(const uint8_t* data, size_t size) {
  if (size < 8) return;
  uint64_t len = 0;
  std::memcpy(&len, data, 8);
  refused_or([&] { runtime::wire::check_meta_len(len, 1); });
  const std::string_view meta(reinterpret_cast<const char*>(data + 8), size - 8);
  refused_or([&] {
    const runtime::Layout layout = runtime::wire::decode_meta(meta, 1);
    if (!(runtime::wire::decode_meta(runtime::wire::encode_meta(layout), 1) == layout))
      fail("wire_meta", "encode/decode round trip differs");
  });
}

// Gloo start-up address blob: byte 0 world size, 1 publisher, 2 reader, then the blob.
void wire_address(const uint8_t* data, size_t size) {
  if (size < 3) return;
  const int world = 1 + data[0] % 16, publisher = data[1] % world, reader = data[2] % world;
  const std::string_view blob(reinterpret_cast<const char*>(data + 3), size - 3);
  refused_or([&] {
    const auto bytes = runtime::wire::address_for(blob, publisher, reader, world);
    if (bytes.size() > blob.size()) fail("wire_address", "address longer than its blob");
  });
}

// Gloo control message (fixed size) and the NCCL abort note from the store.
void wire_control(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const int world = 1 + data[0] % 64, peer = data[0] % world;
  runtime::wire::ControlMsg m;
  std::memcpy(&m, data + 1, std::min(size - 1, sizeof(m)));
  const auto c = runtime::wire::decode_control(m, peer, world);
  if (c.origin < 0 || c.origin >= world) fail("wire_control", "control origin out of range");
  if (c.text.size() >= sizeof(m.text)) fail("wire_control", "control text not bounded");
  const std::string_view note(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto a = runtime::wire::decode_abort_note(note, world);
  if (a.origin < -1 || a.origin >= world) fail("wire_control", "abort-note origin out of range");
  if (a.reason.size() > note.size()) fail("wire_control", "abort-note reason longer than the note");
}

// The hardware description of a cluster (baton-plan --cluster, cost/hardware.cc).
void hardware_json(const uint8_t* data, size_t size) {
  refused_or([&] {
    const Hardware h = Hardware::from_json(text_of(data, size));
    if (!(Hardware::from_json(h.to_json()) == h))
      fail("hardware_json", "to/from JSON round trip differs");
  });
}

// A model profile for cluster planning (baton-plan --profile, cost/profile.cc).
void profile_json(const uint8_t* data, size_t size) {
  refused_or([&] { (void)ModelProfile::from_json(text_of(data, size)); });
}

const Target kTargets[] = {
    {"schedule_text", schedule_text}, {"cost_json", cost_json}, {"segment_json", segment_json},
    {"plan_options", plan_options},   {"wire_meta", wire_meta}, {"wire_address", wire_address},
    {"wire_control", wire_control},   {"hardware_json", hardware_json},
    {"profile_json", profile_json},
};

}  // namespace

const Target* targets(size_t* count) {
  *count = sizeof(kTargets) / sizeof(kTargets[0]);
  return kTargets;
}

}  // namespace baton::fuzz
