// RankComm: the transfers of compiled rank programs (what the XLA FFI handlers
// call), over the in-process and Gloo transports.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

#include "baton/comm.h"

namespace baton::runtime {
namespace {

using std::chrono::milliseconds;

CommOp op(CommOpKind k, int peer, int channel = 0, int stage = 0) {
  return CommOp{k, peer, channel, stage};
}

std::vector<float> iota(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

ConstBytes in(const std::vector<float>& v) { return {v.data(), v.size() * sizeof(float)}; }
MutBytes out(std::vector<float>& v) { return {v.data(), v.size() * sizeof(float)}; }

struct Pair {
  std::shared_ptr<RankComm> a, b;
};

Pair local_pair(size_t n, milliseconds timeout = milliseconds(5000)) {
  auto hub = LocalHub::create(2);
  Pair p{std::make_shared<RankComm>(0, timeout), std::make_shared<RankComm>(1, timeout)};
  p.a->attach(std::shared_ptr<Transport>(hub->transport(0)));
  p.b->attach(std::shared_ptr<Transport>(hub->transport(1)));
  for (auto* c : {p.a.get(), p.b.get()}) {
    c->set_layout(0, 0, {n * sizeof(float)});
    c->set_layout(1, 1, {n * sizeof(float), n * sizeof(float)});
  }
  return p;
}

TEST(RuntimeComm, SendPostWaitMovesTheBytes) {
  auto p = local_pair(64);
  const auto x = iota(64, 1.0f);
  p.a->run_group({op(CommOpKind::Send, 1)}, {in(x)}, {});
  std::vector<float> y(64, 0.0f);
  p.b->run_group({op(CommOpKind::Post, 0), op(CommOpKind::Wait, 0)}, {}, {out(y)});
  EXPECT_EQ(x, y);
  p.a->drain();
  EXPECT_EQ(p.a->counts().first, 1u);
  EXPECT_EQ(p.b->counts().second, 1u);
}

TEST(RuntimeComm, TransfersPairInFifoOrderPerPeerAndChannel) {
  // Three act sends and one grad send (two tensors) interleaved; the receiver posts all,
  // then waits channel by channel: each wait gets the oldest of its channel.
  auto p = local_pair(8);
  const auto a0 = iota(8, 0), a1 = iota(8, 100), a2 = iota(8, 200);
  const auto g0 = iota(8, -50), g1 = iota(8, -90);
  p.a->run_group({op(CommOpKind::Send, 1), op(CommOpKind::Send, 1, 1, 1), op(CommOpKind::Send, 1),
                  op(CommOpKind::Send, 1)},
                 {in(a0), in(g0), in(g1), in(a1), in(a2)}, {});
  std::vector<float> r0(8), r1(8), r2(8), h0(8), h1(8);
  p.b->run_group({op(CommOpKind::Post, 0), op(CommOpKind::Post, 0), op(CommOpKind::Post, 0, 1, 1),
                  op(CommOpKind::Wait, 0, 1, 1), op(CommOpKind::Wait, 0)},
                 {}, {out(h0), out(h1), out(r0)});
  // a wait with nothing posted posts its receive itself
  p.b->run_group({op(CommOpKind::Wait, 0), op(CommOpKind::Wait, 0)}, {}, {out(r1), out(r2)});
  EXPECT_EQ(r0, a0);
  EXPECT_EQ(r1, a1);
  EXPECT_EQ(r2, a2);
  EXPECT_EQ(h0, g0);
  EXPECT_EQ(h1, g1);
}

TEST(RuntimeComm, WaitTimesOutNamingRankAndTransfer) {
  auto p = local_pair(4, milliseconds(200));
  std::vector<float> y(4);
  const auto t0 = Clock::now();
  try {
    p.b->run_group({op(CommOpKind::Wait, 0)}, {}, {out(y)});
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1: timed out after 0.2 s receiving act(stage 0) #0 "
                                         "from rank 0"),
              std::string::npos)
        << e.what();
    EXPECT_EQ(e.failed_rank, 1);
  }
  EXPECT_LT(Clock::now() - t0, milliseconds(2000));
  ASSERT_TRUE(p.b->failure().has_value());
  EXPECT_EQ(p.b->failure()->first, 1);
  // the peer learns at once: its next transfer fails naming rank 1
  const auto x = iota(4, 0);
  try {
    p.a->run_group({op(CommOpKind::Send, 1), op(CommOpKind::Wait, 1)}, {in(x)}, {out(y)});
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    EXPECT_EQ(e.failed_rank, 1) << e.what();
  }
}

TEST(RuntimeComm, AbortFailsThePeersPendingWaitAtOnce) {
  auto p = local_pair(4, milliseconds(30000));
  std::vector<float> y(4);
  auto waiting = std::async(std::launch::async, [&] {
    try {
      p.b->run_group({op(CommOpKind::Post, 0), op(CommOpKind::Wait, 0)}, {}, {out(y)});
    } catch (const ExecutionError& e) {
      return e.failed_rank;
    }
    return -100;
  });
  std::this_thread::sleep_for(milliseconds(50));
  const auto t0 = Clock::now();
  p.a->abort("rank 0: the task raised ValueError: boom", 0);
  EXPECT_EQ(waiting.get(), 0);
  EXPECT_LT(Clock::now() - t0, milliseconds(2000));
  ASSERT_TRUE(p.b->failure().has_value());
  EXPECT_NE(p.b->failure()->second.find("boom"), std::string::npos);
}

TEST(RuntimeComm, SizeMismatchIsAClearError) {
  auto p = local_pair(4);
  const auto x = iota(5, 0);  // 20 bytes, the layout says 16
  try {
    p.a->run_group({op(CommOpKind::Send, 1)}, {in(x)}, {});
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    EXPECT_NE(std::string(e.what()).find("has 20 bytes, the receiver expects 16"),
              std::string::npos)
        << e.what();
  }
}

TEST(RuntimeComm, ReattachResetsCountersAndFailure) {
  auto p = local_pair(4, milliseconds(100));
  std::vector<float> y(4);
  EXPECT_THROW(p.b->run_group({op(CommOpKind::Wait, 0)}, {}, {out(y)}), ExecutionError);
  auto hub = LocalHub::create(2);
  p.a->attach(std::shared_ptr<Transport>(hub->transport(0)));
  p.b->attach(std::shared_ptr<Transport>(hub->transport(1)));
  EXPECT_FALSE(p.b->failure().has_value());
  const auto x = iota(4, 7);
  p.a->run_group({op(CommOpKind::Send, 1)}, {in(x)}, {});
  p.b->run_group({op(CommOpKind::Wait, 0)}, {}, {out(y)});
  EXPECT_EQ(x, y);
}

TEST(RuntimeComm, RecordsTransferEvents) {
  auto p = local_pair(4);
  p.a->record(true);
  p.b->record(true);
  const auto x = iota(4, 0);
  std::vector<float> y(4);
  p.a->run_group({op(CommOpKind::Send, 1)}, {in(x)}, {});
  p.a->drain();
  p.b->run_group({op(CommOpKind::Post, 0), op(CommOpKind::Wait, 0)}, {}, {out(y)});
  auto ea = p.a->take_events(), eb = p.b->take_events();
  ASSERT_EQ(ea.size(), 1u);
  ASSERT_EQ(eb.size(), 1u);
  EXPECT_EQ(ea[0].kind, CommOpKind::Send);
  EXPECT_EQ(eb[0].kind, CommOpKind::Post);
  EXPECT_LE(eb[0].posted, eb[0].completed);
  EXPECT_TRUE(p.a->take_events().empty());
}

TEST(RuntimeComm, GlooTransfersBetweenTwoRanks) {
  auto store = make_hash_store();
  GlooOptions o;
  o.connect_timeout = milliseconds(20000);
  std::shared_ptr<Transport> t0, t1;
  std::thread th([&] { t1 = make_gloo_transport(1, 2, store, o); });
  t0 = make_gloo_transport(0, 2, store, o);
  th.join();
  const size_t n = 1 << 16;  // 256 KiB
  RankComm a(0, milliseconds(10000)), b(1, milliseconds(10000));
  a.attach(t0);
  b.attach(t1);
  a.set_layout(0, 0, {n * sizeof(float)});
  b.set_layout(0, 0, {n * sizeof(float)});
  a.set_layout(1, 1, {n * sizeof(float)});
  b.set_layout(1, 1, {n * sizeof(float)});
  const auto x = iota(n, 3), g = iota(n, -7);
  std::vector<float> y(n), h(n);
  std::thread peer([&] {
    b.run_group({op(CommOpKind::Post, 0), op(CommOpKind::Wait, 0), op(CommOpKind::Send, 0, 1, 1)},
                {in(g)}, {out(y)});
    b.drain();
  });
  a.run_group(
      {op(CommOpKind::Send, 1), op(CommOpKind::Post, 1, 1, 1), op(CommOpKind::Wait, 1, 1, 1)},
      {in(x)}, {out(h)});
  a.drain();
  peer.join();
  EXPECT_EQ(x, y);
  EXPECT_EQ(g, h);
  a.detach();
  b.detach();
}

}  // namespace
}  // namespace baton::runtime
