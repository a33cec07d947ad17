// Device-slot routing shared by the CPU (RankComm) and CUDA (NcclComm)
// transfer contexts (slots.h), and the NCCL library rules (nccl_library.h):
// which copy is loaded, and which versions are accepted. All host side.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "baton/comm.h"
#include "baton/nccl_library.h"
#include "baton/slots.h"

namespace baton::runtime {
namespace {

TEST(DeviceSlots, OrdinalsMapToTheirPositions) {
  DeviceSlots none;
  EXPECT_EQ(none.size(), 1);
  EXPECT_EQ(none.slot_of(0), 0);
  EXPECT_EQ(none.slot_of(7), 0);  // one slot: any device
  DeviceSlots s(2, {5, 4, 7, 6});
  EXPECT_EQ(s.size(), 4);
  EXPECT_EQ(s.slot_of(5), 0);
  EXPECT_EQ(s.slot_of(4), 1);
  EXPECT_EQ(s.slot_of(6), 3);
  try {
    s.slot_of(1);
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 2"), std::string::npos) << m;
    EXPECT_NE(m.find("ordinal 1"), std::string::npos) << m;
    EXPECT_NE(m.find("5, 4, 7, 6"), std::string::npos) << m;
    EXPECT_EQ(e.failed_rank, 2);
  }
}

TEST(DeviceSlots, RejectsBadOrdinals) {
  EXPECT_THROW(DeviceSlots(0, {0, 1, 0}), ConfigError);
  EXPECT_THROW(DeviceSlots(0, {-1}), ConfigError);
  std::vector<int> many(kMaxSlots + 1);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<int>(i);
  EXPECT_THROW(DeviceSlots(0, many), ConfigError);
  many.pop_back();
  EXPECT_EQ(DeviceSlots(0, many).size(), kMaxSlots);
}

TEST(SlotRoutes, RoutesSetFoundAndRemoved) {
  struct Ctx {
    int id;
  };
  SlotRoutes<Ctx> r;
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(r.find(3), nullptr);
  auto a = std::make_shared<Ctx>(Ctx{1});
  auto b = std::make_shared<Ctx>(Ctx{2});
  r.set(0, 3, a);
  r.set(0, 1, b);
  EXPECT_EQ(r.find(3), a);
  EXPECT_EQ(r.find(1), b);
  EXPECT_EQ(r.find(2), nullptr);
  EXPECT_EQ(r.ordinals(), (std::vector<int>{1, 3}));
  EXPECT_EQ(r.members().size(), 2u);
  r.set(0, 3, nullptr);
  EXPECT_EQ(r.find(3), nullptr);
  EXPECT_EQ(r.members().size(), 1u);
  try {
    r.set(4, -2, a);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 4"), std::string::npos) << e.what();
  }
}

TEST(SlotRoutes, ConcurrentLookupsWhileOneThreadReads) {
  struct Ctx {
    int id;
  };
  SlotRoutes<Ctx> r;
  std::vector<std::shared_ptr<Ctx>> ctx;
  for (int i = 0; i < 8; ++i) {
    ctx.push_back(std::make_shared<Ctx>(Ctx{i}));
    r.set(0, 10 + i, ctx.back());
  }
  // As XLA's per-device handler calls do: each device looks up its own slot at once.
  std::vector<std::thread> ts;
  std::vector<int> bad(8, 0);
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&, i] {
      for (int k = 0; k < 2000; ++k)
        if (r.find(10 + i)->id != i) ++bad[static_cast<size_t>(i)];
    });
  for (auto& t : ts) t.join();
  for (int b : bad) EXPECT_EQ(b, 0);
}

// RankComm's shards and routes are this same code (set_shards / set_route).
TEST(SlotRoutes, RankCommUsesTheSharedSlots) {
  auto lead = std::make_shared<RankComm>(0, std::chrono::milliseconds(1000));
  auto member = std::make_shared<RankComm>(1, std::chrono::milliseconds(1000));
  lead->set_shards({6, 2});
  EXPECT_EQ(lead->shard_of(6), 0);
  EXPECT_EQ(lead->shard_of(2), 1);
  EXPECT_THROW(lead->shard_of(3), ExecutionError);
  EXPECT_THROW(lead->set_shards({1, 1}), ConfigError);
  lead->set_route(2, member);
  EXPECT_EQ(lead->route(2), member);
  EXPECT_EQ(lead->route(6), nullptr);
  EXPECT_THROW(lead->set_route(-1, member), ConfigError);
}

TEST(NcclLibrary, VersionCodesBothEncodings) {
  EXPECT_EQ(nccl_library::version_parts(22809), (std::array<int, 3>{2, 28, 9}));
  EXPECT_EQ(nccl_library::version_parts(2708), (std::array<int, 3>{2, 7, 8}));
  EXPECT_EQ(nccl_library::version_string(21903), "2.19.3");
}

TEST(NcclLibrary, MajorMustMatchAndNonBlockingSetupMustExist) {
  EXPECT_EQ(nccl_library::version_mismatch(22809, 22809), "");
  EXPECT_EQ(nccl_library::version_mismatch(22104, 22809), "");  // older minor, same major
  EXPECT_EQ(nccl_library::version_mismatch(22809, 21400), "");  // newer library
  const std::string major = nccl_library::version_mismatch(30001, 22809);
  EXPECT_NE(major.find("3.0.1"), std::string::npos) << major;
  EXPECT_NE(major.find("2.28.9"), std::string::npos) << major;
  EXPECT_NE(major.find("major"), std::string::npos) << major;
  const std::string old = nccl_library::version_mismatch(21301, 22809);
  EXPECT_NE(old.find("2.13.1"), std::string::npos) << old;
  EXPECT_NE(old.find("2.14.0"), std::string::npos) << old;
  EXPECT_NE(nccl_library::version_mismatch(2708, 22809), "");  // 2.7.8: too old
}

TEST(NcclLibrary, AMappedCopyIsTheOnlyCandidate) {
  using C = nccl_library::Candidate;
  const auto mapped = nccl_library::load_order({"/site/nvidia/nccl/lib/libnccl.so.2"}, "/x/libnccl.so");
  EXPECT_EQ(mapped, (std::vector<C>{{"/site/nvidia/nccl/lib/libnccl.so.2", true}}));
  const auto env = nccl_library::load_order({}, "/x/libnccl.so");
  EXPECT_EQ(env, (std::vector<C>{{"/x/libnccl.so", false}, {"libnccl.so.2", false},
                                 {"libnccl.so", false}}));
  EXPECT_EQ(nccl_library::load_order({}, ""),
            (std::vector<C>{{"libnccl.so.2", false}, {"libnccl.so", false}}));
  EXPECT_EQ(nccl_library::load_order({}, nullptr).size(), 2u);
}

TEST(NcclLibrary, MappedFindsTheProcessLibraries) {
  // libstdc++ is mapped into every C++ test binary; a made-up name never is.
  const auto std_libs = nccl_library::mapped("libstdc++");
  ASSERT_EQ(std_libs.size(), 1u);
  EXPECT_NE(std_libs[0].find("libstdc++"), std::string::npos);
  EXPECT_TRUE(nccl_library::mapped("libbaton-no-such-library").empty());
}

}  // namespace
}  // namespace baton::runtime
