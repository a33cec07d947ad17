// Gloo transport start-up: rendezvous + connect is bounded by
// GlooOptions::connect_timeout as a whole, and the error names the rank that
// could not be reached; an idle connection outlives the connect timeout.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gloo/transport/tcp/address.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "baton/runtime.h"

namespace baton::runtime {
namespace {

using namespace std::chrono_literals;

// What one rank's make_gloo_transport did: the transport or the error, and
// how long it took.
struct Outcome {
  std::unique_ptr<Transport> transport;
  std::string error;
  int failed_rank = -2;
  std::chrono::milliseconds took{0};
};

Outcome connect_rank(int rank, int world, std::shared_ptr<Store> store, GlooOptions o) {
  Outcome out;
  const auto t0 = Clock::now();
  try {
    out.transport = make_gloo_transport(rank, world, std::move(store), o);
  } catch (const ExecutionError& e) {
    out.error = e.what();
    out.failed_rank = e.failed_rank;
  }
  out.took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  return out;
}

// Connects `ranks` of a world of `world` ranks, one thread each.
std::vector<Outcome> connect_ranks(const std::vector<int>& ranks, int world,
                                   std::shared_ptr<Store> store, GlooOptions o) {
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < ranks.size(); ++i)
    th.emplace_back([&, i] { out[i] = connect_rank(ranks[i], world, store, o); });
  for (auto& t : th) t.join();
  return out;
}

bool has(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

GlooOptions quick(std::chrono::milliseconds timeout, const std::string& prefix) {
  GlooOptions o;
  o.connect_timeout = timeout;
  o.prefix = prefix;
  return o;
}

TEST(RuntimeGlooConnect, MissingRankFailsWithinTimeoutNamingIt) {
  auto store = make_hash_store();
  const auto out = connect_ranks({0}, 2, store, quick(1500ms, "missing2"));  // rank 1 never starts
  ASSERT_FALSE(out[0].transport);
  const std::string& m = out[0].error;
  EXPECT_TRUE(has(m, "rank 0:")) << m;
  EXPECT_TRUE(has(m, "rank(s) 1 ")) << m;
  EXPECT_TRUE(has(m, "1500 ms")) << m;
  EXPECT_EQ(out[0].failed_rank, 1);
  EXPECT_GE(out[0].took, 1400ms);
  // Bounded by the timeout, not by Gloo's own wait (five times it, 7.5 s): 4x
  // leaves room for a loaded 2-core machine yet still tells the two apart.
  EXPECT_LT(out[0].took, 4 * 1500ms);
}

TEST(RuntimeGlooConnect, EveryMissingRankIsNamed) {
  auto store = make_hash_store();
  // World of 4: ranks 1 and 3 start, ranks 0 and 2 never do.
  const auto out = connect_ranks({1, 3}, 4, store, quick(1000ms, "missing4"));
  for (const Outcome& o : out) {
    ASSERT_FALSE(o.transport);
    EXPECT_TRUE(has(o.error, "rank(s) 0, 2 ")) << o.error;
    EXPECT_GE(o.took, 900ms) << o.error;       // waited for the missing ranks
    EXPECT_LT(o.took, 4 * 1000ms) << o.error;  // not Gloo's 5x wait (see above)
  }
}

// A store whose readers see every published Gloo address rewritten by `f`.
class TamperingStore : public Store {
 public:
  explicit TamperingStore(std::function<std::string(const std::string&, std::string)> f)
      : inner_(make_hash_store()), rewrite_(std::move(f)) {}
  void set(const std::string& key, const std::string& value) override { inner_->set(key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return rewrite_(key, inner_->get(key, timeout));
  }

 private:
  std::shared_ptr<Store> inner_;
  std::function<std::string(const std::string&, std::string)> rewrite_;
};

// A TCP port on 127.0.0.1, the first free one of `candidates`, that is bound
// but never listens: connecting to it is refused, and no other socket takes
// it while it lives.
struct DeadPort {
  int fd = -1;
  uint16_t port = 0;
  explicit DeadPort(const std::vector<int>& candidates) {
    for (int p : candidates) {
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(p));
      if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
        port = static_cast<uint16_t>(p);
        return;
      }
      ::close(fd);
      fd = -1;
    }
  }
  ~DeadPort() {
    if (fd >= 0) ::close(fd);
  }
};

// Rewrites every Gloo address in an address blob (see gloo_mesh.cc: per peer a
// 4-byte little-endian length, then tcp::Address bytes) to 127.0.0.1:port.
std::string redirect_addresses(std::string blob, uint16_t port) {
  std::string out;
  size_t i = 0;
  while (i + 4 <= blob.size()) {
    uint32_t n = 0;
    std::memcpy(&n, blob.data() + i, 4);
    i += 4;
    EXPECT_LE(i + n, blob.size());
    gloo::transport::tcp::Address a(std::vector<char>(blob.begin() + static_cast<long>(i),
                                                      blob.begin() + static_cast<long>(i + n)));
    i += n;
    sockaddr_storage ss = a.getSockaddr();
    EXPECT_EQ(ss.ss_family, AF_INET);
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(port);
    const auto bytes = gloo::transport::tcp::Address(ss, a.getSeq()).bytes();
    const auto len = static_cast<uint32_t>(bytes.size());
    out.append(reinterpret_cast<const char*>(&len), 4);
    out.append(bytes.begin(), bytes.end());
  }
  EXPECT_EQ(i, blob.size());
  return out;
}

// The reproduction of two ranks that cannot reach each other (as when each
// advertises 127.0.0.1 from its own network namespace): each reads the other's
// address, but nothing there answers. Both sides fail within the bound, each
// naming the other. Gloo picks which side of a pair listens by comparing the
// two ports as raw network-order integers, i.e. byte-swapped. A dead port whose
// swapped value is above that of every ephemeral port (low byte 0xff, high
// byte above 0xee) makes both ranks listen: they wait until the deadline (the
// case that hung). One whose swapped value is below them all (low byte 0, high
// byte below 0x80) makes both connect: refused at once.
TEST(RuntimeGlooConnect, UnreachablePeerFailsBothSidesWithinTimeout) {
  std::chrono::milliseconds longest{0};
  std::vector<int> above, below;
  for (int hi = 0xef; hi <= 0xff; ++hi) above.push_back(hi << 8 | 0xff);
  for (int hi = 0x7f; hi >= 0x04; --hi) below.push_back(hi << 8);
  for (const auto& candidates : {above, below}) {
    DeadPort dead(candidates);
    ASSERT_NE(dead.port, 0) << "no free port among the candidates";
    SCOPED_TRACE(fmt::format("peers advertised at 127.0.0.1:{}", dead.port));
    auto store = std::make_shared<TamperingStore>([&](const std::string& key, std::string v) {
      return has(key, "/addr/") ? redirect_addresses(std::move(v), dead.port) : v;
    });
    const auto out =
        connect_ranks({0, 1}, 2, store, quick(2000ms, fmt::format("dead{}", dead.port)));
    for (int r : {0, 1}) {
      const Outcome& x = out[static_cast<size_t>(r)];
      ASSERT_FALSE(x.transport) << "rank " << r << " connected";
      EXPECT_TRUE(has(x.error, fmt::format("rank {}:", r))) << x.error;
      EXPECT_TRUE(has(x.error, fmt::format("could not connect to rank(s) {}", 1 - r))) << x.error;
      EXPECT_TRUE(has(x.error, fmt::format("127.0.0.1:{}", dead.port))) << x.error;
      EXPECT_TRUE(has(x.error, "2000 ms")) << x.error;
      EXPECT_EQ(x.failed_rank, 1 - r);
      EXPECT_LT(x.took, 4 * 2000ms) << x.error;  // not the 5x wait of the listening side
      longest = std::max(longest, x.took);
    }
  }
  EXPECT_GE(longest, 1500ms) << "no rank waited as the listening side";
}

// Ranks that start at different times still connect while the later one is
// within everybody's bound.
TEST(RuntimeGlooConnect, LateRankWithinTimeoutConnects) {
  auto store = make_hash_store();
  const GlooOptions o = quick(5000ms, "late");
  Outcome a, b;
  std::thread t([&] { a = connect_rank(0, 2, store, o); });
  std::this_thread::sleep_for(600ms);
  b = connect_rank(1, 2, store, o);
  t.join();
  ASSERT_TRUE(a.transport) << a.error;
  ASSERT_TRUE(b.transport) << b.error;
}

// The connect timeout bounds start-up only: a connection that stays idle for
// longer still carries transfers and is not reported as failed.
TEST(RuntimeGlooConnect, IdleLongerThanConnectTimeoutIsFine) {
  auto store = make_hash_store();
  // 1.5 s to connect (0.3 s was tight for two ranks on a loaded 2-core
  // machine), then idle for twice that.
  auto out = connect_ranks({0, 1}, 2, store, quick(1500ms, "idle"));
  ASSERT_TRUE(out[0].transport && out[1].transport) << out[0].error << out[1].error;
  std::this_thread::sleep_for(3000ms);
  EXPECT_FALSE(out[0].transport->failure().has_value());
  EXPECT_FALSE(out[1].transport->failure().has_value());
  Tasks* none = nullptr;
  struct Plain : Tasks {
    std::vector<Value> run(const TaskCall&) override { return {}; }
    void accumulate(int, int32_t, const Value&) override {}
  } tasks;
  none = &tasks;
  Tensor x = alloc_host_tensor(DType::F32, {4});
  for (int i = 0; i < 4; ++i) static_cast<float*>(x.data)[i] = static_cast<float>(i) + 0.5f;
  auto recv = out[1].transport->irecv(0, 7, "x", none);
  auto send = out[0].transport->isend(1, 7, std::make_shared<HostValue>(Payload{x}), "x", none);
  ASSERT_TRUE(send->wait_until(Clock::now() + 5s));
  ASSERT_TRUE(recv->wait_until(Clock::now() + 5s));
  send->check();
  recv->check();
  auto v = std::dynamic_pointer_cast<HostValue>(recv->take_value());
  ASSERT_TRUE(v);
  ASSERT_EQ(v->tensors.size(), 1u);
  EXPECT_EQ(static_cast<float*>(v->tensors[0].data)[3], 3.5f);
  out[0].transport->release(none);
  out[1].transport->release(none);
}

}  // namespace
}  // namespace baton::runtime
