// RankComm: the transfers of compiled rank programs (what the XLA FFI handlers
// call), over the in-process and Gloo transports.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <tuple>
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

// Two contexts (rank 0 and 1, 10 s timeout) attached to Gloo transports over one hash store.
Pair gloo_pair() {
  auto store = make_hash_store();
  GlooOptions o;
  o.connect_timeout = milliseconds(20000);
  std::shared_ptr<Transport> t0, t1;
  std::thread th([&] { t1 = make_gloo_transport(1, 2, store, o); });
  t0 = make_gloo_transport(0, 2, store, o);
  th.join();
  Pair p{std::make_shared<RankComm>(0, milliseconds(10000)),
         std::make_shared<RankComm>(1, milliseconds(10000))};
  p.a->attach(t0);
  p.b->attach(t1);
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

TEST(RuntimeComm, AliasRunsAnotherRanksOperationsAsItsOwn) {
  // Three ranks: rank 2 runs operations written for rank 1 (peer 0 on channel 0, stage 0:
  // a shared program lowered for rank 1) as its own (peer 1 on channel 1, stage 1).
  auto hub = LocalHub::create(3);
  std::vector<std::shared_ptr<RankComm>> c;
  for (int r = 0; r < 3; ++r) {
    c.push_back(std::make_shared<RankComm>(r, milliseconds(5000)));
    c[r]->attach(std::shared_ptr<Transport>(hub->transport(r)));
    c[r]->set_layout(0, 0, {16 * sizeof(float)});
    c[r]->set_layout(1, 1, {16 * sizeof(float)});
  }
  c[2]->set_alias({{0, 0, 0}}, {{1, 1, 1}});
  const auto x = iota(16, 3.0f);
  c[1]->run_group({op(CommOpKind::Send, 2, 1, 1)}, {in(x)}, {});
  std::vector<float> y(16, 0.0f);
  c[2]->run_group({op(CommOpKind::Wait, 0, 0, 0)}, {}, {out(y)});
  EXPECT_EQ(x, y);
  c[1]->drain();
  // an operation the alias does not name is an internal error, not a transfer elsewhere
  EXPECT_THROW(c[2]->run_group({op(CommOpKind::Wait, 1, 0, 0)}, {}, {out(y)}), ExecutionError);
  // two different targets for one operation
  EXPECT_THROW(c[0]->set_alias({{1, 0, 0}, {1, 0, 0}}, {{2, 0, 0}, {2, 1, 1}}), ConfigError);
  EXPECT_THROW(c[0]->set_alias({{1, 0, 0}}, {}), ConfigError);
}

TEST(RuntimeComm, RouteGivesEachDeviceItsRanksContext) {
  auto a = std::make_shared<RankComm>(1, milliseconds(1000));
  auto b = std::make_shared<RankComm>(2, milliseconds(1000));
  EXPECT_EQ(a->route(7), nullptr);
  a->set_route(7, b);
  EXPECT_EQ(a->route(7), b);
  EXPECT_EQ(a->route(6), nullptr);
  a->set_route(7, nullptr);
  EXPECT_EQ(a->route(7), nullptr);
  EXPECT_THROW(a->set_route(-1, b), ConfigError);
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
  // Order, not speed: the 0.2 s wait ran out before the error; a hang (no
  // timeout at all) is what the upper bound catches, so it is generous.
  EXPECT_GE(Clock::now() - t0, milliseconds(200));
  EXPECT_LT(Clock::now() - t0, milliseconds(20000));
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
  // "At once" means through the abort, not the 30 s wait timeout: anything
  // under half of it (a loaded 2-core machine can stall a thread for seconds).
  EXPECT_LT(Clock::now() - t0, milliseconds(15000));
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
  auto p = gloo_pair();
  RankComm &a = *p.a, &b = *p.b;
  const size_t n = 1 << 16;  // 256 KiB
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

// ---------------------------------------------------------------- shards

// One step of a 2-rank exchange on `shard` (its own thread): rank a sends three act
// tensors and one grad buffer (two tensors) and waits for one act back; rank b posts,
// waits in FIFO order and sends back. Payloads depend on shard and step.
void shard_step_a(RankComm& a, int shard, int step, size_t n, std::vector<float>& back) {
  const float base = 10000.0f * static_cast<float>(shard) + 100.0f * static_cast<float>(step);
  const auto x0 = iota(n, base), x1 = iota(n, base + 10), x2 = iota(n, base + 20);
  const auto g0 = iota(n, -base - 1), g1 = iota(n, -base - 2);
  a.run_group({op(CommOpKind::Send, 1), op(CommOpKind::Post, 1)}, {in(x0)}, {}, shard);
  a.run_group({op(CommOpKind::Send, 1, 1, 1), op(CommOpKind::Send, 1)}, {in(g0), in(g1), in(x1)},
              {}, shard);
  a.run_group({op(CommOpKind::Send, 1), op(CommOpKind::Wait, 1)}, {in(x2)}, {out(back)}, shard);
}

void shard_step_b(RankComm& b, int shard, size_t n, std::vector<std::vector<float>>& got) {
  got.assign(6, std::vector<float>(n));
  b.run_group({op(CommOpKind::Post, 0), op(CommOpKind::Post, 0), op(CommOpKind::Post, 0, 1, 1)}, {},
              {}, shard);
  b.run_group({op(CommOpKind::Wait, 0, 1, 1), op(CommOpKind::Wait, 0)}, {},
              {out(got[3]), out(got[4]), out(got[0])}, shard);
  b.run_group({op(CommOpKind::Wait, 0), op(CommOpKind::Wait, 0)}, {}, {out(got[1]), out(got[2])},
              shard);
  // sends back the sum of what it got on act
  got[5] = got[0];
  for (size_t i = 0; i < n; ++i) got[5][i] += got[1][i] + got[2][i];
  b.run_group({op(CommOpKind::Send, 0)}, {in(got[5])}, {}, shard);
}

void run_sharded_steps(RankComm& a, RankComm& b, int shards, int steps, size_t n) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(2 * shards));
  for (int s = 0; s < shards; ++s) {
    threads.emplace_back([&, s] {
      try {
        for (int step = 0; step < steps; ++step) {
          std::vector<float> back(n);
          shard_step_a(a, s, step, n, back);
          const float base = 10000.0f * static_cast<float>(s) + 100.0f * static_cast<float>(step);
          std::vector<float> want(n);
          for (size_t i = 0; i < n; ++i)
            want[i] = 3 * (base + static_cast<float>(i)) + 30;  // x0 + x1 + x2
          EXPECT_EQ(back, want) << "shard " << s << " step " << step;
          a.drain(s);
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(s)] = e.what();
      }
    });
    threads.emplace_back([&, s] {
      try {
        for (int step = 0; step < steps; ++step) {
          std::vector<std::vector<float>> got;
          shard_step_b(b, s, n, got);
          const float base = 10000.0f * static_cast<float>(s) + 100.0f * static_cast<float>(step);
          EXPECT_EQ(got[0], iota(n, base)) << "shard " << s << " step " << step;
          EXPECT_EQ(got[1], iota(n, base + 10));
          EXPECT_EQ(got[2], iota(n, base + 20));
          EXPECT_EQ(got[3], iota(n, -base - 1));
          EXPECT_EQ(got[4], iota(n, -base - 2));
          b.drain(s);
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(shards + s)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(RuntimeComm, ShardsExchangeWithTheSameShardOfThePeer) {
  auto p = local_pair(16);
  // the ranks' devices differ (ordinals 4, 5 and 6, 7); shard i meets shard i
  p.a->set_shards({4, 5});
  p.b->set_shards({7, 6});
  EXPECT_EQ(p.a->num_shards(), 2);
  EXPECT_EQ(p.a->shard_of(5), 1);
  EXPECT_EQ(p.b->shard_of(7), 0);
  EXPECT_THROW(p.a->shard_of(6), ExecutionError);
  p.a->record(true);
  p.b->record(true);
  run_sharded_steps(*p.a, *p.b, 2, 20, 16);
  // per step and shard: a sends 4 (3 act, 1 grad), posts 1; b posts 4, sends 1
  EXPECT_EQ(p.a->counts(), std::make_pair(uint64_t{2 * 20 * 4}, uint64_t{2 * 20 * 1}));
  EXPECT_EQ(p.b->counts(), std::make_pair(uint64_t{2 * 20 * 1}, uint64_t{2 * 20 * 4}));
  // events: every shard's, each with its own seq numbering
  const auto ea = p.a->take_events();
  ASSERT_EQ(ea.size(), 2u * 20 * 5);
  std::map<std::tuple<int, int, int, int>, uint64_t> next;  // (shard, kind, peer, channel)
  for (const CommEvent& e : ea) {
    ASSERT_TRUE(e.shard == 0 || e.shard == 1);
    auto& want = next[{e.shard, static_cast<int>(e.kind), e.peer, e.channel}];
    EXPECT_EQ(e.seq, want++);
    EXPECT_LE(e.posted, e.completed);
  }
  EXPECT_EQ((next[{0, 0, 1, 0}]), 60u);
  EXPECT_EQ((next[{1, 0, 1, 0}]), 60u);
  EXPECT_EQ((next[{1, 0, 1, 1}]), 20u);
  EXPECT_EQ((next[{1, 1, 1, 0}]), 20u);
  EXPECT_FALSE(p.a->failure().has_value());
}

TEST(RuntimeComm, ShardsOverGloo) {
  auto p = gloo_pair();
  RankComm &a = *p.a, &b = *p.b;
  const size_t n = 4096;
  for (RankComm* c : {&a, &b}) {
    c->set_shards({0, 1, 2});
    c->set_layout(0, 0, {n * sizeof(float)});
    c->set_layout(1, 1, {n * sizeof(float), n * sizeof(float)});
  }
  run_sharded_steps(a, b, 3, 5, n);
  EXPECT_FALSE(a.failure().has_value());
  a.detach();
  b.detach();
}

TEST(RuntimeComm, AFailureOnOneShardFailsTheOtherShardsWaitsAtOnce) {
  auto p = local_pair(4, milliseconds(30000));
  p.a->set_shards({0, 1});
  p.b->set_shards({2, 3});
  std::vector<float> y1(4), y0(4);
  auto wait_on = [](RankComm& c, int shard, int peer, std::vector<float>& y) {
    return std::async(std::launch::async, [&c, shard, peer, &y] {
      try {
        c.run_group({op(CommOpKind::Post, peer), op(CommOpKind::Wait, peer)}, {}, {out(y)}, shard);
      } catch (const ExecutionError& e) {
        return e.failed_rank;
      }
      return -100;
    });
  };
  auto b1 = wait_on(*p.b, 1, 0, y1);  // rank 1's other shard
  auto a0 = wait_on(*p.a, 0, 1, y0);  // the peer's shard 0
  std::this_thread::sleep_for(milliseconds(50));
  const auto t0 = Clock::now();
  const auto x = iota(5, 0);  // 20 bytes, the layout says 16
  try {
    p.b->run_group({op(CommOpKind::Send, 0)}, {in(x)}, {}, 0);
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    EXPECT_EQ(e.failed_rank, 1);
  }
  EXPECT_EQ(b1.get(), 1);
  EXPECT_EQ(a0.get(), 1);
  EXPECT_LT(Clock::now() - t0, milliseconds(15000));  // the failure, not the 30 s timeout
  // recorded once: the first failure (the size mismatch), on both ranks' side
  ASSERT_TRUE(p.b->failure().has_value());
  EXPECT_NE(p.b->failure()->second.find("has 20 bytes, the receiver expects 16"), std::string::npos)
      << p.b->failure()->second;
  EXPECT_EQ(p.b->failure()->first, 1);
  // a shard's later call fails at once
  const auto t1 = Clock::now();
  EXPECT_THROW(p.b->run_group({op(CommOpKind::Wait, 0)}, {}, {out(y1)}, 1), ExecutionError);
  EXPECT_LT(Clock::now() - t1, milliseconds(15000));  // not the 30 s timeout
}

TEST(RuntimeComm, ShardTimeoutNamesTheShardAndFailsTheOthers) {
  auto p = local_pair(4, milliseconds(300));
  p.b->set_shards({0, 1});
  std::vector<float> y0(4), y1(4);
  std::string m0, m1;
  std::thread th([&] {
    try {
      p.b->run_group({op(CommOpKind::Wait, 0)}, {}, {out(y1)}, 1);
    } catch (const ExecutionError& e) {
      m1 = e.what();
    }
  });
  try {
    p.b->run_group({op(CommOpKind::Wait, 0)}, {}, {out(y0)}, 0);
  } catch (const ExecutionError& e) {
    m0 = e.what();
  }
  th.join();
  // one of them timed out first (its shard named); the other failed through the abort
  ASSERT_TRUE(p.b->failure().has_value());
  const std::string first = p.b->failure()->second;
  EXPECT_NE(
      first.find("rank 1: timed out after 0.3 s receiving act(stage 0) #0 from rank 0 (shard "),
      std::string::npos)
      << first;
  EXPECT_FALSE(m0.empty());
  EXPECT_FALSE(m1.empty());
}

// Three ranks in a chain: rank 0 waits for rank 1, which waits for rank 2, which is
// alive but silent (its heartbeat is off, as a stopped process's would stop). Rank 0's
// timeout must name rank 2, not the healthy rank 1 it waited for.
TEST(RuntimeComm, TimeoutBlamesTheSilentPeerNotTheOneWaitedFor) {
  auto store = make_hash_store();
  std::vector<std::shared_ptr<Transport>> t(3);
  std::vector<std::thread> th;
  for (int r = 0; r < 3; ++r)
    th.emplace_back([&, r] {
      GlooOptions o;
      o.connect_timeout = milliseconds(20000);
      o.heartbeat = milliseconds(r == 2 ? 0 : 200);
      t[static_cast<size_t>(r)] = make_gloo_transport(r, 3, store, o);
    });
  for (auto& x : th) x.join();
  std::vector<std::shared_ptr<RankComm>> c;
  for (int r = 0; r < 3; ++r) {
    // rank 0 gives up first (3 s); rank 1 would wait 20 s
    c.push_back(std::make_shared<RankComm>(r, milliseconds(r == 0 ? 3000 : 20000)));
    c.back()->attach(t[static_cast<size_t>(r)]);
    c.back()->set_layout(0, 0, {4 * sizeof(float)});
  }
  std::vector<float> y0(4), y1(4);
  std::string m1;
  std::thread waiter([&] {
    try {
      c[1]->run_group({op(CommOpKind::Wait, 2)}, {}, {out(y1)});
    } catch (const ExecutionError& e) {
      m1 = e.what();
    }
  });
  try {
    c[0]->run_group({op(CommOpKind::Wait, 1)}, {}, {out(y0)});
    FAIL() << "no error";
  } catch (const ExecutionError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 0: timed out after 3 s receiving act(stage 0) #0 from rank 1"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("silent (no heartbeat): rank 2 for "), std::string::npos) << m;
    EXPECT_NE(m.find("that rank 1 may be waiting for"), std::string::npos) << m;
    EXPECT_EQ(m.find("rank 1 for"), std::string::npos) << m;  // rank 1 kept beating
    EXPECT_EQ(e.failed_rank, 2);
  }
  waiter.join();  // rank 1 stops at once: rank 0's abort reached it
  EXPECT_NE(m1.find("rank 2"), std::string::npos) << m1;
  ASSERT_TRUE(c[1]->failure().has_value());
  EXPECT_EQ(c[1]->failure()->first, 2);
  // A rank without a heartbeat knows of no silence; no transport, no note.
  EXPECT_TRUE(t[2]->silent_peers().empty());
  const TimeoutBlame none = blame_silence(nullptr, 1, 0);
  EXPECT_EQ(none.origin, 0);
  EXPECT_TRUE(none.note.empty());
}

TEST(RuntimeComm, TagsOfDifferentShardsNeverCollide) {
  std::set<uint64_t> seen;
  for (uint64_t seq = 0; seq < 10; ++seq)
    for (int ch = 0; ch < kCommChannels; ++ch)
      for (int sh = 0; sh < kCommShards; ++sh) {
        const uint64_t t = comm_tag(seq, ch, sh);
        EXPECT_GE(t, kCommTagBase);
        EXPECT_LT(t, uint64_t{1} << 44);  // below the Router's
        EXPECT_TRUE(seen.insert(t).second) << seq << " " << ch << " " << sh;
      }
  EXPECT_EQ(comm_tag(0, 0, 0), kCommTagBase);
  // the largest tag stays within the program range [2^42, 2^43)
  const uint64_t top = (uint64_t{1} << 28) - 1;
  EXPECT_EQ(comm_tag(top, kCommChannels - 1, kCommShards - 1), (uint64_t{1} << 43) - 1);
  // seq wraps (transfers in flight are never 2^28 apart)
  EXPECT_EQ(comm_tag(top + 1, 3, 9), comm_tag(0, 3, 9));
  EXPECT_THROW(comm_tag(0, 0, kCommShards), ExecutionError);
  EXPECT_THROW(comm_tag(0, kCommChannels, 0), ExecutionError);
  EXPECT_THROW(comm_tag(0, -1, 0), ExecutionError);
  EXPECT_THROW(comm_tag(0, 0, -1), ExecutionError);
}

TEST(RuntimeComm, SetShardsChecksTheOrdinals) {
  RankComm c(0, milliseconds(100));
  EXPECT_TRUE(c.shards().empty());
  EXPECT_EQ(c.num_shards(), 1);
  EXPECT_EQ(c.shard_of(0), 0);
  EXPECT_EQ(c.shard_of(17), 0);  // one shard: any device
  EXPECT_THROW(c.set_shards({0, 1, 0}), ConfigError);
  EXPECT_THROW(c.set_shards({-1}), ConfigError);
  std::vector<int> many(static_cast<size_t>(kCommShards) + 1);
  std::iota(many.begin(), many.end(), 0);
  EXPECT_THROW(c.set_shards(many), ConfigError);
  many.pop_back();
  c.set_shards(many);
  EXPECT_EQ(c.num_shards(), kCommShards);
  EXPECT_EQ(c.shard_of(255), 255);
  c.set_shards({});
  EXPECT_EQ(c.num_shards(), 1);
  EXPECT_EQ(c.shard_of(3), 0);
  EXPECT_THROW(c.drain(1), ExecutionError);  // no such shard
}

TEST(RuntimeComm, MarksAreShardZeros) {
  RankComm c(0, milliseconds(100));
  c.set_shards({3, 2});
  c.record(true);
  c.mark(0, 0);
  c.mark(0, 1);
  c.mark(1, 1);
  c.mark(1, 0);
  const auto m = c.take_marks();
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].first, 0);
  EXPECT_EQ(m[1].first, 1);
  EXPECT_TRUE(c.take_marks().empty());
}

}  // namespace
}  // namespace baton::runtime
