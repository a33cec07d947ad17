// Host-staged transfers (host_staged.h) with a StagingDevice that logs its
// calls and copies with memcpy: the order of copies, events and RankComm
// operations, and the bytes moved; and the choice of transport.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "baton/comm.h"
#include "baton/host_staged.h"

namespace baton::runtime {
namespace {

using std::chrono::milliseconds;

// A log shared by the fake device and the test's transport probe.
struct Log {
  std::mutex mu;
  std::vector<std::string> lines;
  void add(std::string s) {
    std::lock_guard<std::mutex> g(mu);
    lines.push_back(std::move(s));
  }
  size_t index(const std::string& s) {
    std::lock_guard<std::mutex> g(mu);
    for (size_t i = 0; i < lines.size(); ++i)
      if (lines[i] == s) return i;
    ADD_FAILURE() << "not logged: " << s;
    return SIZE_MAX;
  }
};

// Streams: "xla" is the handle the test passes, "copy" the device's own.
class FakeDevice : public StagingDevice {
 public:
  explicit FakeDevice(std::shared_ptr<Log> log) : log_(std::move(log)) {}
  Stream copy_stream() override { return &copy_; }
  void* alloc_pinned(size_t bytes) override {
    log_->add("alloc " + std::to_string(bytes));
    bufs_.emplace_back(new unsigned char[bytes]);
    return bufs_.back().get();
  }
  void free_pinned(void*) override { log_->add("free"); }
  Event create_event() override {
    events_.emplace_back(new int(static_cast<int>(events_.size())));
    return events_.back().get();
  }
  void destroy_event(Event) override {}
  void copy_d2h(void* host, const void* device, size_t bytes, Stream s) override {
    std::memcpy(host, device, bytes);
    log_->add("d2h " + std::to_string(bytes) + " on " + name(s));
  }
  void copy_h2d(void* device, const void* host, size_t bytes, Stream s) override {
    std::memcpy(device, host, bytes);
    log_->add("h2d " + std::to_string(bytes) + " on " + name(s));
  }
  void record(Event e, Stream s) override { log_->add("record e" + ev(e) + " on " + name(s)); }
  void wait(Stream s, Event e) override { log_->add(name(s) + " waits e" + ev(e)); }
  void sync(Event e) override { log_->add("host syncs e" + ev(e)); }

  static int xla;  // the address is the XLA stream handle

 private:
  std::string name(Stream s) const { return s == &copy_ ? "copy" : s == &xla ? "xla" : "?"; }
  static std::string ev(Event e) { return std::to_string(*static_cast<int*>(e)); }
  std::shared_ptr<Log> log_;
  int copy_ = 0;
  std::vector<std::unique_ptr<unsigned char[]>> bufs_;
  std::vector<std::unique_ptr<int>> events_;
};
int FakeDevice::xla = 0;

// A transport that logs when RankComm hands it a send or a finished receive.
class LoggingTransport : public Transport {
 public:
  LoggingTransport(std::shared_ptr<Transport> inner, std::shared_ptr<Log> log)
      : inner_(std::move(inner)), log_(std::move(log)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string kind() const override { return inner_->kind(); }
  RequestPtr isend(int peer, uint64_t tag, Value v, const std::string& what, Tasks* tasks,
                   int channel, const Layout& layout) override {
    log_->add("transport send to " + std::to_string(peer));
    return inner_->isend(peer, tag, std::move(v), what, tasks, channel, layout);
  }
  RequestPtr irecv(int peer, uint64_t tag, const std::string& what, Tasks* tasks, int channel,
                   const Layout& layout) override {
    log_->add("transport recv from " + std::to_string(peer));
    return inner_->irecv(peer, tag, what, tasks, channel, layout);
  }
  void flush() override { inner_->flush(); }
  void release(Tasks* tasks) override { inner_->release(tasks); }
  std::vector<std::string> exchange(const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    return inner_->exchange(mine, timeout);
  }
  void abort(const std::string& msg, int origin) override { inner_->abort(msg, origin); }
  std::optional<std::pair<int, std::string>> failure() const override {
    return inner_->failure();
  }

 private:
  std::shared_ptr<Transport> inner_;
  std::shared_ptr<Log> log_;
};

std::vector<float> iota(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(RuntimeHostStaged, SendCopiesAfterTheProducerThenSendsAndReceiveCopiesAfterArrival) {
  constexpr size_t n = 16, bytes = n * sizeof(float);
  auto hub = LocalHub::create(2);
  auto log0 = std::make_shared<Log>(), log1 = std::make_shared<Log>();
  auto c0 = std::make_shared<RankComm>(0, milliseconds(5000));
  auto c1 = std::make_shared<RankComm>(1, milliseconds(5000));
  c0->attach(std::make_shared<LoggingTransport>(std::shared_ptr<Transport>(hub->transport(0)),
                                                log0));
  c1->attach(std::make_shared<LoggingTransport>(std::shared_ptr<Transport>(hub->transport(1)),
                                                log1));
  for (auto* c : {c0.get(), c1.get()}) c->set_layout(0, 0, {bytes});
  HostStagedComm s0(c0, std::make_unique<FakeDevice>(log0));
  HostStagedComm s1(c1, std::make_unique<FakeDevice>(log1));

  const auto x = iota(n, 1.0f);  // "device" memory of rank 0
  std::vector<float> y(n, 0.0f);  // "device" memory of rank 1
  std::thread recv([&] {
    s1.run_group({{CommOpKind::Post, 0, 0, 0}, {CommOpKind::Wait, 0, 0, 0}}, {},
                 {{y.data(), bytes}}, &FakeDevice::xla);
  });
  // the receiver is waiting when the bytes leave: its H2D copy (a memcpy here, run when
  // issued) reads them only if it is issued after the receive completed
  std::this_thread::sleep_for(milliseconds(50));
  s0.run_group({{CommOpKind::Send, 1, 0, 0}}, {{x.data(), bytes}}, {}, &FakeDevice::xla);
  recv.join();
  c0->drain();
  EXPECT_EQ(x, y);

  // sender: the copy stream waits for XLA's work, the host for the copy, then the send
  const std::vector<std::string> want0 = {"alloc 64",         "record e0 on xla",
                                          "copy waits e0",    "d2h 64 on copy",
                                          "record e1 on copy", "host syncs e1",
                                          "transport send to 1"};
  EXPECT_EQ(log0->lines, want0);
  // receiver: the receive completes before the H2D copy; XLA's stream waits on it
  EXPECT_LT(log1->index("transport recv from 0"), log1->index("h2d 64 on copy"));
  const std::vector<std::string> tail = {"h2d 64 on copy", "record e1 on copy", "xla waits e1",
                                         "host syncs e1"};
  ASSERT_GE(log1->lines.size(), tail.size());
  EXPECT_EQ(std::vector<std::string>(log1->lines.end() - 4, log1->lines.end()), tail);
  EXPECT_EQ(s0.staging_bytes(), bytes);
  EXPECT_EQ(s1.staging_bytes(), bytes);
}

TEST(RuntimeHostStaged, StagingGrowsToTheLargestGroupAndIsReused) {
  constexpr size_t n = 8, bytes = n * sizeof(float);
  auto hub = LocalHub::create(2);
  auto log = std::make_shared<Log>();
  auto c0 = std::make_shared<RankComm>(0, milliseconds(5000));
  auto c1 = std::make_shared<RankComm>(1, milliseconds(5000));
  c0->attach(std::shared_ptr<Transport>(hub->transport(0)));
  c1->attach(std::shared_ptr<Transport>(hub->transport(1)));
  for (auto* c : {c0.get(), c1.get()}) c->set_layout(0, 0, {bytes});
  HostStagedComm s0(c0, std::make_unique<FakeDevice>(log));
  HostStagedComm s1(c1, std::make_unique<FakeDevice>(std::make_shared<Log>()));
  const auto a = iota(n, 0.0f), b = iota(n, 100.0f);
  std::vector<float> ra(n), rb(n);
  for (int step = 0; step < 2; ++step) {
    // one group sends and receives: staging holds both
    std::thread t([&] {
      s1.run_group({{CommOpKind::Post, 0, 0, 0}, {CommOpKind::Wait, 0, 0, 0},
                    {CommOpKind::Send, 0, 0, 0}},
                   {{b.data(), bytes}}, {{ra.data(), bytes}}, &FakeDevice::xla);
    });
    s0.run_group({{CommOpKind::Send, 1, 0, 0}, {CommOpKind::Post, 1, 0, 0},
                  {CommOpKind::Wait, 1, 0, 0}},
                 {{a.data(), bytes}}, {{rb.data(), bytes}}, &FakeDevice::xla);
    t.join();
    c0->drain();
    c1->drain();
    EXPECT_EQ(ra, a);
    EXPECT_EQ(rb, b);
  }
  EXPECT_EQ(s0.staging_bytes(), 2 * bytes);
  size_t allocs = 0;
  for (const auto& l : log->lines) allocs += l.rfind("alloc", 0) == 0;
  EXPECT_EQ(allocs, 1u);
}

TEST(RuntimeHostStaged, AFailedReceiveCopiesNothingToTheDevice) {
  auto hub = LocalHub::create(2);
  auto log = std::make_shared<Log>();
  auto c1 = std::make_shared<RankComm>(1, milliseconds(200));
  c1->attach(std::shared_ptr<Transport>(hub->transport(1)));
  c1->set_layout(0, 0, {16});
  HostStagedComm s1(c1, std::make_unique<FakeDevice>(log));
  std::vector<unsigned char> y(16);
  EXPECT_THROW(s1.run_group({{CommOpKind::Post, 0, 0, 0}, {CommOpKind::Wait, 0, 0, 0}}, {},
                            {{y.data(), 16}}, &FakeDevice::xla),
               ExecutionError);
  for (const auto& l : log->lines) EXPECT_EQ(l.find("h2d"), std::string::npos) << l;
}

TEST(RuntimeHostStaged, RegistryFindsByTheRankCommId) {
  auto c = std::make_shared<RankComm>(0, milliseconds(1000));
  const int64_t id = register_comm(c);
  EXPECT_EQ(find_staged_comm(id), nullptr);
  auto staged = std::make_shared<HostStagedComm>(
      c, std::make_unique<FakeDevice>(std::make_shared<Log>()));
  register_staged_comm(id, staged);
  EXPECT_EQ(find_staged_comm(id), staged);
  EXPECT_EQ(&find_staged_comm(id)->comm(), c.get());
  unregister_staged_comm(id);
  EXPECT_EQ(find_staged_comm(id), nullptr);
  unregister_staged_comm(id);  // unknown ids are ignored
  unregister_comm(id);
}

TEST(RuntimeHostStaged, TransportChoice) {
  auto nccl = choose_cuda_transport({"a", "a"}, {0, 1}, true, "");
  EXPECT_EQ(nccl.transport, CudaTransport::Nccl);
  EXPECT_TRUE(nccl.reason.empty());
  // two ranks on one GPU of one host
  auto shared = choose_cuda_transport({"a", "a", "a"}, {0, 1, 0}, true, "");
  EXPECT_EQ(shared.transport, CudaTransport::HostStaged);
  EXPECT_NE(shared.reason.find("ranks 0 and 2 share GPU 0 on a"), std::string::npos)
      << shared.reason;
  // the same ordinal on two hosts is two GPUs
  EXPECT_EQ(choose_cuda_transport({"a", "b"}, {0, 0}, true, "").transport, CudaTransport::Nccl);
  auto none = choose_cuda_transport({"a", "a"}, {0, 1}, false, "libnccl.so.2 not found");
  EXPECT_EQ(none.transport, CudaTransport::HostStaged);
  EXPECT_NE(none.reason.find("NCCL unavailable (libnccl.so.2 not found)"), std::string::npos)
      << none.reason;
  EXPECT_EQ(none.reason.find('\n'), std::string::npos);  // one log line
  EXPECT_THROW(choose_cuda_transport({"a"}, {0, 1}, true, ""), std::invalid_argument);
  EXPECT_THROW(choose_cuda_transport({"a"}, {-1}, true, ""), std::invalid_argument);
}

}  // namespace
}  // namespace baton::runtime
