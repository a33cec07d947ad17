// Transfer benchmark: see baton/transfer_bench.h.
#include "baton/transfer_bench.h"

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "baton/comm.h"
#include "baton/error.h"

namespace baton::runtime {

namespace {

// Through RankComm: SEND + POST, then WAIT on `a`; WAIT, then SEND on `b`.
double through_rank_comm(const std::shared_ptr<Transport>& ta, const std::shared_ptr<Transport>& tb,
                         size_t nbytes, int iters, std::chrono::milliseconds timeout) {
  std::vector<char> x(nbytes, 1), y(nbytes, 0);
  RankComm ca(ta->rank(), timeout), cb(tb->rank(), timeout);
  ca.attach(ta);
  cb.attach(tb);
  for (auto* c : {&ca, &cb}) c->set_layout(0, 0, {nbytes});
  const int pa = ta->rank(), pb = tb->rank();
  std::thread peer([&] {
    std::vector<char> buf(nbytes);
    for (int i = 0; i < iters; ++i) {
      cb.run_group({{CommOpKind::Wait, pa, 0, 0}}, {}, {{buf.data(), nbytes}});
      cb.run_group({{CommOpKind::Send, pa, 0, 0}}, {{buf.data(), nbytes}}, {});
    }
    cb.drain();
  });
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    ca.run_group({{CommOpKind::Send, pb, 0, 0}, {CommOpKind::Post, pb, 0, 0}}, {{x.data(), nbytes}},
                 {});
    ca.run_group({{CommOpKind::Wait, pb, 0, 0}}, {}, {{y.data(), nbytes}});
  }
  ca.drain();
  peer.join();
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

// Straight on the transports: `a` sends a fresh host tensor ("ping"), `b`
// sends back the value it received ("pong").
double on_transports(const std::shared_ptr<Transport>& ta, const std::shared_ptr<Transport>& tb,
                     size_t nbytes, int iters, std::chrono::milliseconds timeout) {
  // host tensors only: the Tasks defaults convert HostValues
  struct HostCodec : Tasks {
    std::vector<Value> run(const TaskCall&) override { return {}; }
    void accumulate(int, int32_t, const Value&) override {}
  } codec;
  Tasks* host = &codec;
  const Layout layout{{DType::U8, {static_cast<int64_t>(nbytes)}}};
  auto value = [&] {
    return std::make_shared<HostValue>(
        Payload{alloc_host_tensor(DType::U8, {static_cast<int64_t>(nbytes)})});
  };
  const uint64_t base = uint64_t{1} << 40;
  // sends are waited for at the end, as RankComm's are (drain)
  std::thread peer([&] {
    std::vector<RequestPtr> sent;
    for (int i = 0; i < iters; ++i) {
      auto r = tb->irecv(ta->rank(), base + 2 * i, "ping", host, 0, layout);
      tb->flush();
      r->wait_until(Clock::now() + timeout);
      sent.push_back(
          tb->isend(ta->rank(), base + 2 * i + 1, r->take_value(), "pong", host, 0, layout));
      tb->flush();
    }
    for (auto& s : sent) s->wait_until(Clock::now() + timeout);
  });
  const auto t0 = Clock::now();
  std::vector<RequestPtr> sent;
  for (int i = 0; i < iters; ++i) {
    sent.push_back(ta->isend(tb->rank(), base + 2 * i, value(), "ping", host, 0, layout));
    auto r = ta->irecv(tb->rank(), base + 2 * i + 1, "pong", host, 0, layout);
    ta->flush();
    r->wait_until(Clock::now() + timeout);
    r->check();
  }
  for (auto& s : sent) s->wait_until(Clock::now() + timeout);
  peer.join();
  ta->release(host);
  tb->release(host);
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

}  // namespace

double pingpong_seconds(const std::shared_ptr<Transport>& a, const std::shared_ptr<Transport>& b,
                        size_t nbytes, int iters, bool through_comm) {
  if (!a || !b) throw ConfigError("the transport is closed");
  const auto timeout = std::chrono::milliseconds(60000);
  return through_comm ? through_rank_comm(a, b, nbytes, iters, timeout)
                      : on_transports(a, b, nbytes, iters, timeout);
}

}  // namespace baton::runtime
