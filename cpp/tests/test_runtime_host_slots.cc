// HostSlots (host_slots.h): the host memory of offloaded buffers behind the
// baton_offload / baton_fetch FFI handlers.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "baton/host_slots.h"

namespace {

using baton::runtime::HostSlots;

TEST(RuntimeHostSlots, BytesComeBackAndHeldAndPeakCount) {
  HostSlots h;
  const std::vector<float> a{1, 2, 3}, b{4, 5};
  h.put(0, 0, a.data(), a.size() * sizeof(float));
  h.put(0, 1, b.data(), b.size() * sizeof(float));
  EXPECT_EQ(h.held_bytes(), 20u);
  std::vector<float> got(3);
  h.take(0, 0, got.data(), got.size() * sizeof(float));
  EXPECT_EQ(got, a);
  EXPECT_EQ(h.held_bytes(), 8u);
  EXPECT_EQ(h.peak_bytes(), 20u);
  // the slot is free again for the next buffer
  h.put(0, 0, b.data(), b.size() * sizeof(float));
  EXPECT_EQ(h.held_bytes(), 16u);
  EXPECT_EQ(h.peak_bytes(), 20u);
  h.reset_peak();
  EXPECT_EQ(h.peak_bytes(), 16u);
}

TEST(RuntimeHostSlots, ShardsKeepTheirOwnSlots) {
  HostSlots h;
  const int32_t x = 7, y = 9;
  h.put(0, 3, &x, sizeof x);
  h.put(1, 3, &y, sizeof y);
  int32_t got = 0;
  h.take(1, 3, &got, sizeof got);
  EXPECT_EQ(got, 9);
  h.take(0, 3, &got, sizeof got);
  EXPECT_EQ(got, 7);
  EXPECT_EQ(h.held_bytes(), 0u);
}

TEST(RuntimeHostSlots, MisuseIsAnErrorNamingTheSlot) {
  HostSlots h;
  const int32_t x = 1;
  int32_t got = 0;
  try {
    h.take(0, 5, &got, sizeof got);
    FAIL() << "a fetch from an empty slot must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("host slot 5 (shard 0), which holds no buffer"),
              std::string::npos)
        << e.what();
  }
  h.put(0, 5, &x, sizeof x);
  EXPECT_THROW(h.put(0, 5, &x, sizeof x), std::runtime_error);  // still held
  int64_t wide = 0;
  try {
    h.take(0, 5, &wide, sizeof wide);
    FAIL() << "a fetch of another size must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("FETCH of 8 bytes from host slot 5 (shard 0), which "
                                         "holds 4 bytes"),
              std::string::npos)
        << e.what();
  }
  h.take(0, 5, &got, sizeof got);  // the failed fetch left it held
  EXPECT_EQ(got, 1);
}

}  // namespace
