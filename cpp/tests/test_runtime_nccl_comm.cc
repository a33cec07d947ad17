// NcclComm's host-side logic (nccl_comm.h, staging::): link ordering, slot
// packing, the staging pool's bookkeeping with a fake device, FIFO matching,
// the once-only abort guard; and that constructing NcclComm without a CUDA
// device (or without CUDA in the build) throws a clear ConfigError.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "baton/nccl_comm.h"

namespace baton::runtime {
namespace {

using staging::LinkKey;

TEST(NcclCommLinks, CanonicalOrderIsTheSameOnBothEnds) {
  // rank 0 sends act to 1, receives grad from 1; rank 1 the reverse; listed in
  // different orders and with a duplicate.
  auto r0 =
      staging::canonical_links(0, 3, {{1, 1, false}, {1, 0, true}, {2, 0, true}, {1, 0, true}});
  auto r1 = staging::canonical_links(1, 3, {{0, 0, false}, {0, 1, true}});
  ASSERT_EQ(r0.size(), 3u);
  EXPECT_EQ(r0[0], (LinkKey{0, 1, 0}));
  EXPECT_EQ(r0[1], (LinkKey{0, 2, 0}));
  EXPECT_EQ(r0[2], (LinkKey{1, 0, 1}));
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r1[0], (LinkKey{0, 1, 0}));
  EXPECT_EQ(r1[1], (LinkKey{1, 0, 1}));
  // The links both ranks share appear in the same relative order.
  std::vector<LinkKey> shared0;
  for (const auto& k : r0)
    if ((k.src == 0 && k.dst == 1) || (k.src == 1 && k.dst == 0)) shared0.push_back(k);
  EXPECT_EQ(shared0, r1);
}

TEST(NcclCommLinks, RejectsBadPeersAndChannels) {
  // A self link: both directions are one key (a 1-rank communicator).
  EXPECT_EQ(staging::canonical_links(0, 2, {{0, 0, true}, {0, 0, false}}),
            (std::vector<LinkKey>{{0, 0, 0}}));
  EXPECT_THROW(staging::canonical_links(0, 2, {{2, 0, true}}), ConfigError);   // out of range
  EXPECT_THROW(staging::canonical_links(0, 2, {{-1, 0, true}}), ConfigError);  // negative
  EXPECT_THROW(staging::canonical_links(0, 2, {{1, -1, true}}), ConfigError);  // channel
  EXPECT_TRUE(staging::canonical_links(0, 1, {}).empty());
}

TEST(NcclCommStaging, PackedOffsetsAreAligned) {
  auto o = staging::packed_offsets({10, 300, 0, 4});
  ASSERT_EQ(o.size(), 5u);
  EXPECT_EQ(o[0], 0u);
  EXPECT_EQ(o[1], 256u);
  EXPECT_EQ(o[2], 768u);
  EXPECT_EQ(o[3], 768u);
  EXPECT_EQ(o[4], 772u);
  EXPECT_EQ(staging::packed_offsets({}).back(), 0u);
  EXPECT_EQ(staging::packed_offsets({7}, 1).back(), 7u);
}

using Counts = std::vector<staging::TransferCount>;
using Spans = std::vector<staging::InFlight>;

// A fake device: buffers are host allocations, fences are flags a test flips.
struct FakeDevice {
  std::map<void*, size_t> live;
  std::set<void*> done_fences;
  std::vector<void*> released;
  size_t allocs = 0, frees = 0;
  staging::SlotPool pool() {
    return staging::SlotPool(
        [this](size_t n) {
          void* p = ::operator new(n);
          live[p] = n;
          ++allocs;
          return p;
        },
        [this](void* p) {
          live.erase(p);
          ++frees;
          ::operator delete(p);
        },
        [this](void* f) { return done_fences.count(f) > 0; },
        [this](void* f) { released.push_back(f); });
  }
};

TEST(NcclCommStaging, SlotsAreReusedBySizeAfterTheirFence) {
  FakeDevice dev;
  int fence_a = 0, fence_b = 0, fence_c = 0;
  {
    auto pool = dev.pool();
    EXPECT_EQ(pool.take(0), nullptr);
    void* a = pool.take(1024);
    void* b = pool.take(1024);
    EXPECT_NE(a, b);
    EXPECT_EQ(pool.allocations(), 2u);
    pool.retire(a, 1024, &fence_a);
    pool.retire(b, 1024, &fence_b);
    // Fences pending: a new slot is allocated.
    void* c = pool.take(1024);
    EXPECT_EQ(pool.allocations(), 3u);
    EXPECT_EQ(pool.retired_count(), 2u);
    // Fence b completes: b comes back (and its fence is released), a does not.
    dev.done_fences.insert(&fence_b);
    EXPECT_EQ(pool.take(1024), b);
    EXPECT_EQ(pool.allocations(), 3u);
    EXPECT_EQ(dev.released, std::vector<void*>{&fence_b});
    EXPECT_EQ(pool.retired_count(), 1u);
    // Another size never reuses a 1024-byte slot.
    void* d = pool.take(512);
    EXPECT_EQ(pool.allocations(), 4u);
    EXPECT_EQ(dev.live[d], 512u);
    // A null fence frees at once.
    pool.retire(c, 1024, nullptr);
    EXPECT_EQ(pool.free_count(), 1u);
    EXPECT_EQ(pool.take(1024), c);
    // Steady state: retire and take again, fences completed: no allocation.
    for (int step = 0; step < 100; ++step) {
      pool.retire(c, 1024, &fence_c);
      dev.done_fences.insert(&fence_c);
      EXPECT_EQ(pool.take(1024), c);
    }
    EXPECT_EQ(pool.allocations(), 4u);
    pool.retire(d, 512, nullptr);
    pool.retire(b, 1024, nullptr);
    pool.retire(c, 1024, nullptr);
    EXPECT_EQ(pool.reclaim(), 0u);  // a's fence still pending
    EXPECT_EQ(pool.retired_count(), 1u);
  }
  // The destructor frees every buffer (free and retired) and releases pending fences.
  EXPECT_TRUE(dev.live.empty());
  EXPECT_EQ(dev.frees, dev.allocs);
  EXPECT_EQ(dev.released.back(), static_cast<void*>(&fence_a));
}

TEST(NcclCommStaging, ReserveAllocatesBeforeTheFirstTakeAndNotAgain) {
  FakeDevice dev;
  auto pool = dev.pool();
  EXPECT_EQ(pool.reserve(1024, 3), 3u);
  EXPECT_EQ(pool.reserve(1024, 2), 0u);  // already 3 of that size
  EXPECT_EQ(pool.reserve(0, 5), 0u);     // empty transfers need no slot
  EXPECT_EQ(pool.allocations(), 3u);
  EXPECT_EQ(pool.free_count(), 3u);
  // Three in flight at once: served from the reservation, nothing allocated.
  int fence = 0;
  std::vector<void*> taken;
  for (int step = 0; step < 10; ++step) {
    for (int i = 0; i < 3; ++i) taken.push_back(pool.take(1024));
    for (void* p : taken) pool.retire(p, 1024, &fence);
    taken.clear();
    dev.done_fences.insert(&fence);
  }
  EXPECT_EQ(pool.allocations(), 3u);
  // A fourth at once still works (grows the pool), and reserve counts it.
  for (int i = 0; i < 4; ++i) taken.push_back(pool.take(1024));
  EXPECT_EQ(pool.allocations(), 4u);
  EXPECT_EQ(pool.reserve(1024, 4), 0u);
  for (void* p : taken) pool.retire(p, 1024, nullptr);
}

TEST(NcclCommStaging, ReservationFromLayoutsAndTransferCounts) {
  CommLayouts layouts;
  layouts[{0, 1}] = {100, 300};  // act of stage 1: packed 256 + 300 = 556 bytes
  layouts[{1, 2}] = {512};       // grad of stage 2
  layouts[{2, 0}] = {};          // an empty buffer
  const staging::Reservation r = staging::reservation(
      layouts, 1, Counts{{0, 1, true, 8}, {1, 2, false, 8}, {0, 1, false, 2}, {2, 0, true, 4}});
  ASSERT_EQ(r.slots.size(), 2u);
  EXPECT_EQ(r.slots.at(556), 10u);
  EXPECT_EQ(r.slots.at(512), 8u);
  EXPECT_EQ(r.events, 2u * 8 + 3u * 8 + 3u * 2 + 2u * 4);
  // A transfer whose layout was never given names the rank and the buffer.
  try {
    staging::reservation(layouts, 3, Counts{{1, 7, false, 1}});
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(staging::reservation(layouts, 1, Counts{{0, 1, true, -1}}), ConfigError);
}

// A hand-written rank program's transfers (positions are instruction indices):
//   0 POST send act(s0,m0)   1 POST send act(s0,m1)   2 POST recv grad(s1,m0)
//   3 RUN                    4 FREE act(s0,m0)        5 POST send act(s0,m2)
//   6 WAIT grad(s1,m0)       7 POST recv grad(s1,m1)  8 FREE act(s0,m1)
//   9 WAIT grad(s1,m1)      10 FREE act(s0,m2)
// Sends in flight: [0,4] [1,8] [5,10]: at most 2 at once (of 3). Receives:
// [2,6] [7,9]: at most 1 at once (of 2).
TEST(NcclCommStaging, ReservationIsTheMostInFlightAtOnceNotTheSum) {
  CommLayouts layouts;
  layouts[{0, 0}] = {1 << 20, 100};  // act of stage 0: packed 1 MiB + 256-aligned 100 bytes
  layouts[{1, 1}] = {4096};          // grad of stage 1
  const size_t act = (1u << 20) + 100, grad = 4096;
  const std::vector<staging::InFlight> prog = {{0, 0, true, 0, 4},
                                               {0, 0, true, 1, 8},
                                               {1, 1, false, 2, 6},
                                               {0, 0, true, 5, 10},
                                               {1, 1, false, 7, 9}};
  const staging::Reservation r = staging::reservation(layouts, 2, prog);
  EXPECT_EQ(r.send_bytes, 2 * act);  // not 3 * act (the step's sends)
  EXPECT_EQ(r.recv_bytes, grad);     // not 2 * grad
  EXPECT_EQ(r.slots.at(act), 2u);
  EXPECT_EQ(r.slots.at(grad), 1u);
  EXPECT_EQ(r.send_slots.at(act), 2u);
  EXPECT_EQ(r.send_slots.count(grad), 0u);
  EXPECT_EQ(r.events, 2u * 2 + 3u * 1);
  // Touching intervals overlap ([0,4] and [4,6]); adjacent ones do not ([0,4], [5,6]).
  EXPECT_EQ(
      staging::reservation(layouts, 2, Spans{{1, 1, false, 0, 4}, {1, 1, false, 4, 6}}).recv_bytes,
      2 * grad);
  EXPECT_EQ(
      staging::reservation(layouts, 2, Spans{{1, 1, false, 0, 4}, {1, 1, false, 5, 6}}).recv_bytes,
      grad);
  // to < 0: in flight to the step's end, so it overlaps everything after it.
  EXPECT_EQ(
      staging::reservation(layouts, 2, Spans{{1, 1, false, 0, -1}, {1, 1, false, 9, 9}}).recv_bytes,
      2 * grad);
  // The counts form: every transfer in flight at once (the sum).
  const staging::Reservation all =
      staging::reservation(layouts, 2, Counts{{0, 0, true, 3}, {1, 1, false, 2}});
  EXPECT_EQ(all.send_bytes, 3 * act);
  EXPECT_EQ(all.recv_bytes, 2 * grad);
  // An interval that ends before it starts names the rank and the transfer.
  try {
    staging::reservation(layouts, 5, Spans{{0, 0, true, 7, 3}});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 5"), std::string::npos) << m;
    EXPECT_NE(m.find("send"), std::string::npos) << m;
    EXPECT_NE(m.find("stage 0"), std::string::npos) << m;
  }
}

TEST(NcclCommStaging, ReservationsOfProgramsSharingAContextMergePerSize) {
  CommLayouts layouts;
  layouts[{0, 0}] = {1024};
  layouts[{1, 1}] = {4096};
  // A: two 1024-byte sends at once, one 4096-byte receive; B: one send, three receives.
  const staging::Reservation a = staging::reservation(
      layouts, 0, Spans{{0, 0, true, 0, 5}, {0, 0, true, 1, 5}, {1, 1, false, 2, 3}});
  const staging::Reservation b = staging::reservation(
      layouts, 0,
      Spans{{0, 0, true, 0, 1}, {1, 1, false, 0, 9}, {1, 1, false, 1, 9}, {1, 1, false, 2, 9}});
  const staging::Reservation m = staging::merged(a, b);
  EXPECT_EQ(m.slots.at(1024), 2u);
  EXPECT_EQ(m.slots.at(4096), 3u);
  EXPECT_EQ(m.send_slots.at(1024), 2u);
  EXPECT_EQ(m.send_bytes, 2u * 1024);
  EXPECT_EQ(m.recv_bytes, 3u * 4096);
  EXPECT_EQ(m.events, std::max(a.events, b.events));
  // Merging into nothing (the first reserve) is the reservation itself.
  const staging::Reservation first = staging::merged(staging::Reservation{}, a);
  EXPECT_EQ(first.slots, a.slots);
  EXPECT_EQ(first.send_slots, a.send_slots);
  EXPECT_EQ(first.send_bytes, a.send_bytes);
  EXPECT_EQ(first.recv_bytes, a.recv_bytes);
}

TEST(NcclCommStaging, ReservationErrorsNameRankDirectionAndBytes) {
  CommLayouts layouts;
  layouts[{0, 0}] = {512u << 20};  // 512 MiB
  layouts[{1, 1}] = {1024};
  const staging::Reservation r = staging::reservation(
      layouts, 3, Spans{{0, 0, false, 0, 9}, {0, 0, false, 1, 9}, {1, 1, true, 2, 3}});
  const std::string f = staging::reserve_failure(3, 512u << 20, r, "out of memory");
  EXPECT_NE(f.find("rank 3"), std::string::npos) << f;
  EXPECT_NE(f.find("for receives"), std::string::npos) << f;
  EXPECT_NE(f.find("2 slots of 512.00 MiB (536870912 bytes)"), std::string::npos) << f;
  EXPECT_NE(f.find("1.00 GiB (1073741824 bytes) in all"), std::string::npos) << f;
  EXPECT_NE(f.find("out of memory"), std::string::npos) << f;
  EXPECT_NE(staging::reserve_failure(3, 1024, r, "x").find("staging for sends"), std::string::npos);
  const std::string b =
      staging::beyond_reservation(4, true, 1024, "act(s1,m3) to rank 2", 1, r, 0.5);
  EXPECT_NE(b.find("rank 4: a send (act(s1,m3) to rank 2) needs 0.00 MiB (1024 bytes)"),
            std::string::npos)
      << b;
  EXPECT_NE(b.find("1 slot of that size reserved"), std::string::npos) << b;
  EXPECT_NE(staging::beyond_reservation(4, false, 8, "x", 0, r, 0).find("a receive (x)"),
            std::string::npos);
}

TEST(NcclCommStaging, CappedPoolWaitsForAFreeSlotAndNeverAllocates) {
  FakeDevice dev;
  auto pool = dev.pool();
  EXPECT_EQ(pool.reserve(1024, 2), 2u);
  pool.cap(true);
  void* a = pool.take(1024);
  void* b = pool.take(1024);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.take(1024), nullptr);  // a third at once: nothing allocated
  EXPECT_EQ(pool.allocations(), 2u);
  // A size never reserved: null at once, without waiting.
  const auto far = std::chrono::steady_clock::now() + std::chrono::hours(1);
  EXPECT_EQ(pool.take_within(512, nullptr, far), nullptr);
  // Both held past the deadline: null after polling.
  int polls = 0;
  EXPECT_EQ(pool.take_within(
                1024, [&] { ++polls; }, std::chrono::steady_clock::now()),
            nullptr);
  EXPECT_GE(polls, 1);
  // The poll hands one back (as reaping a completed send does): that one.
  int fence = 0;
  pool.retire(a, 1024, &fence);
  polls = 0;
  void* c = pool.take_within(
      1024,
      [&] {
        if (++polls == 3) dev.done_fences.insert(&fence);
      },
      far);
  EXPECT_EQ(c, a);
  EXPECT_EQ(polls, 3);
  EXPECT_EQ(pool.allocations(), 2u);
  pool.retire(b, 1024, nullptr);
  pool.retire(c, 1024, nullptr);
  // Uncapped again: grows.
  pool.cap(false);
  std::vector<void*> taken;
  for (int i = 0; i < 3; ++i) taken.push_back(pool.take_within(1024, nullptr, far));
  EXPECT_EQ(pool.allocations(), 3u);
  for (void* p : taken) pool.retire(p, 1024, nullptr);
}

TEST(NcclCommStaging, FifoMatchesPerPeerAndChannel) {
  staging::LinkFifo<int> f;
  // Sequence numbers per (peer, channel, direction).
  EXPECT_EQ(f.next_send(1, 0), 0u);
  EXPECT_EQ(f.next_send(1, 0), 1u);
  EXPECT_EQ(f.next_send(1, 1), 0u);
  EXPECT_EQ(f.next_send(2, 0), 0u);
  EXPECT_EQ(f.next_recv(1, 0), 0u);
  // The k-th posted receive of (peer, channel) is the k-th waited for,
  // independent of other links' traffic.
  EXPECT_TRUE(f.empty(1, 0));
  f.push(1, 0, 10);
  f.push(1, 1, 20);
  f.push(1, 0, 11);
  f.push(2, 0, 30);
  EXPECT_EQ(f.pending(), 4u);
  EXPECT_EQ(f.pop(1, 1), 20);
  EXPECT_EQ(f.pop(1, 0), 10);
  EXPECT_EQ(f.pop(2, 0), 30);
  EXPECT_FALSE(f.empty(1, 0));
  EXPECT_EQ(f.pop(1, 0), 11);
  EXPECT_TRUE(f.empty(1, 0));
  EXPECT_EQ(f.pending(), 0u);
}

TEST(NcclCommStaging, AbortOnceAcrossThreads) {
  staging::AbortOnce guard;
  EXPECT_FALSE(guard.done());
  std::atomic<int> firsts{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&] {
      for (int k = 0; k < 100; ++k)
        if (guard.first()) ++firsts;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(firsts.load(), 1);
  EXPECT_TRUE(guard.done());
}

TEST(NcclCommRegistry, IdsAreUniqueAndApartFromRankComm) {
  const int64_t rc = register_comm(std::make_shared<RankComm>(0, std::chrono::milliseconds(10)));
  // No NcclComm can be built here; the registry takes null for bookkeeping.
  const int64_t a = register_nccl_comm(nullptr);
  const int64_t b = register_nccl_comm(nullptr);
  EXPECT_NE(a, b);
  EXPECT_GE(a, int64_t{1} << 40);
  EXPECT_NE(a, rc);
  EXPECT_EQ(find_nccl_comm(a), nullptr);
  EXPECT_EQ(find_nccl_comm(rc), nullptr);
  EXPECT_EQ(find_comm(a), nullptr);
  unregister_nccl_comm(a);
  unregister_nccl_comm(b);
  unregister_comm(rc);
  EXPECT_GT(register_nccl_comm(nullptr), b);  // never reused
}

// Without a CUDA device (or without CUDA in the build) construction throws a
// clear ConfigError, never crashes. No links: with a GPU it simply succeeds
// (nothing to connect), so the test never waits for a peer.
TEST(NcclCommConstruct, WithoutADeviceThrowsClearly) {
  try {
    NcclComm c(0, 1, 0, make_hash_store(), {}, std::chrono::milliseconds(1000));
    EXPECT_TRUE(NcclComm::built());
    // scripts/test.sh sets BATON_EXPECT_NO_GPU on a machine without an NVIDIA
    // device: construction must fail there.
    EXPECT_EQ(std::getenv("BATON_EXPECT_NO_GPU"), nullptr) << "constructed without a GPU";
    EXPECT_TRUE(c.alive());
    c.close();
    EXPECT_FALSE(c.alive());
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    if (!NcclComm::built())
      EXPECT_NE(msg.find("built without CUDA"), std::string::npos) << msg;
    else
      EXPECT_TRUE(msg.find("needs a CUDA device") != std::string::npos ||
                  msg.find("cannot load NCCL") != std::string::npos)
          << msg;
    if (NcclComm::built() && std::getenv("BATON_EXPECT_NO_GPU")) {
      EXPECT_NE(msg.find("needs a CUDA device"), std::string::npos) << msg;
    }
  }
}

// The message of the ConfigError `f` throws ("" when it throws nothing else).
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

// Bad arguments are refused by name before CUDA is touched: the same message in
// every build (with or without CUDA) and on every machine (with or without a GPU).
TEST(NcclCommConstruct, BadArgumentsThrowBeforeTouchingCuda) {
  const auto ms = std::chrono::milliseconds(10);
  std::string m = config_error([&] { NcclComm(0, 2, 0, nullptr, {}, ms); });
  EXPECT_TRUE(has(m, "a rendezvous store is required")) << m;
  m = config_error([&] { NcclComm(2, 2, 0, make_hash_store(), {}, ms); });
  EXPECT_TRUE(has(m, "rank 2 is invalid for world size 2")) << m;
  m = config_error([&] { NcclComm(0, 2, 0, make_hash_store(), {{5, 0, true}}, ms); });
  EXPECT_TRUE(has(m, "NCCL link of rank 0: peer 5 is invalid (world size 2)")) << m;
  m = config_error([&] { NcclComm(0, 2, 0, make_hash_store(), {{1, -1, false}}, ms); });
  EXPECT_TRUE(has(m, "NCCL link of rank 0: channel -1 is negative")) << m;
}

// A self link (a rank sending to itself) is valid: it passes the argument checks
// and is one 1-rank communicator whose send and receive directions share a key.
TEST(NcclCommConstruct, SelfLinkIsAcceptedAsOneKey) {
  EXPECT_NO_THROW(staging::check_arguments(0, 2, true, {{0, 0, true}, {0, 0, false}}));
  const auto keys = staging::canonical_links(0, 2, {{0, 0, true}, {0, 0, false}});
  ASSERT_EQ(keys.size(), 1u);
  EXPECT_EQ(keys[0], (staging::LinkKey{0, 0, 0}));
  // Constructing with it fails, if at all, only for want of CUDA, a GPU or NCCL.
  const std::string msg = config_error([&] {
    NcclComm c(0, 1, 0, make_hash_store(), {{0, 0, true}, {0, 0, false}},
               std::chrono::milliseconds(1000));
    c.close();
  });
  if (std::getenv("BATON_EXPECT_NO_GPU") && NcclComm::built()) {
    EXPECT_TRUE(has(msg, "needs a CUDA device")) << msg;
  }
  if (!msg.empty()) {
    EXPECT_TRUE(has(msg, "built without CUDA") || has(msg, "needs a CUDA device") ||
                has(msg, "cannot load NCCL"))
        << msg;
    EXPECT_FALSE(has(msg, "invalid")) << msg;
  }
}

}  // namespace
}  // namespace baton::runtime
