// In-process transport: executors in one process hand value handles over.
#include <fmt/format.h>

#include <map>
#include <queue>
#include <thread>
#include <tuple>

#include "baton/runtime.h"

namespace baton::runtime {

using Key = std::tuple<int, int, uint64_t>;  // (src, dst, tag)

struct LocalHub::State {
  int world = 0;
  TransportOptions opts;
  std::mutex mu;
  std::condition_variable cv;
  std::map<Key, Value> mailbox;             // sent, not yet received
  std::map<Key, RequestPtr> waiting;        // receives posted before their send
  std::vector<RequestPtr> in_flight_sends;  // delayed sends
  bool failed = false;
  int failed_origin = -1;
  std::string failed_reason;
  // Handshake rounds: round -> blobs per rank.
  std::map<int, std::vector<std::optional<std::string>>> rounds;
  std::vector<int> next_round;

  // Delayed deliveries (opts.delay > 0), run by one timer thread.
  struct Delivery {
    Clock::time_point at;
    Key key;
    Value value;
    RequestPtr send;
    bool operator>(const Delivery& o) const { return at > o.at; }
  };
  std::priority_queue<Delivery, std::vector<Delivery>, std::greater<>> timers;
  std::thread timer;
  bool stop = false;

  ~State() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (timer.joinable()) timer.join();
  }

  std::exception_ptr failure_error() const {
    return std::make_exception_ptr(ExecutionError(
        fmt::format("rank {} failed: {}", failed_origin, failed_reason), failed_origin));
  }

  // Caller holds mu. Hands `v` to the receiver of `key`.
  void deliver(const Key& key, Value v, const RequestPtr& send) {
    auto it = waiting.find(key);
    if (it != waiting.end()) {
      RequestPtr r = it->second;
      waiting.erase(it);
      r->complete(std::move(v));
    } else {
      mailbox[key] = std::move(v);
    }
    if (send) send->complete();
  }

  void timer_loop() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      if (timers.empty()) {
        cv.wait(lock);
        continue;
      }
      const auto at = timers.top().at;
      if (Clock::now() < at) {
        cv.wait_until(lock, at);
        continue;
      }
      Delivery d = timers.top();
      timers.pop();
      if (!failed) deliver(d.key, std::move(d.value), d.send);
    }
  }
};

std::shared_ptr<LocalHub> LocalHub::create(int world_size, TransportOptions opts) {
  if (world_size < 1) throw ConfigError(fmt::format("world size {} must be >= 1", world_size));
  auto hub = std::shared_ptr<LocalHub>(new LocalHub());
  hub->world_ = world_size;
  hub->state_ = std::make_shared<State>();
  hub->state_->world = world_size;
  hub->state_->opts = opts;
  hub->state_->next_round.assign(static_cast<size_t>(world_size), 0);
  if (opts.delay.count() > 0) {
    State* st = hub->state_.get();
    st->timer = std::thread([st] { st->timer_loop(); });
  }
  return hub;
}

namespace {

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalHub::State> st, int rank) : st_(std::move(st)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return st_->world; }
  std::string kind() const override { return "local"; }

  void check_peer(int peer) const {
    if (peer < 0 || peer >= st_->world || peer == rank_)
      throw ConfigError(
          fmt::format("rank {}: invalid peer rank {} (world size {})", rank_, peer, st_->world));
  }

  RequestPtr isend(int peer, uint64_t tag, Value v, const std::string& what, Tasks*, int,
                   const Layout&) override {
    check_peer(peer);
    auto r = std::make_shared<Request>(true, peer, tag, what);
    std::lock_guard<std::mutex> lock(st_->mu);
    if (st_->failed) {
      r->fail(st_->failure_error());
      return r;
    }
    const Key key{rank_, peer, tag};
    if (st_->opts.delay.count() > 0) {
      r->mark_started();
      st_->in_flight_sends.push_back(r);
      st_->timers.push({Clock::now() + st_->opts.delay, key, std::move(v), r});
      st_->cv.notify_all();
    } else {
      st_->deliver(key, std::move(v), r);
    }
    return r;
  }

  RequestPtr irecv(int peer, uint64_t tag, const std::string& what, Tasks*, int,
                   const Layout&) override {
    check_peer(peer);
    auto r = std::make_shared<Request>(false, peer, tag, what);
    std::lock_guard<std::mutex> lock(st_->mu);
    if (st_->failed) {
      r->fail(st_->failure_error());
      return r;
    }
    const Key key{peer, rank_, tag};
    auto it = st_->mailbox.find(key);
    if (it != st_->mailbox.end()) {
      Value v = std::move(it->second);
      st_->mailbox.erase(it);
      r->complete(std::move(v));
    } else {
      st_->waiting[key] = r;
    }
    return r;
  }

  std::vector<std::string> exchange(const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(st_->mu);
    const int round = st_->next_round[static_cast<size_t>(rank_)]++;
    auto& blobs = st_->rounds[round];
    blobs.resize(static_cast<size_t>(st_->world));
    blobs[static_cast<size_t>(rank_)] = mine;
    st_->cv.notify_all();
    const bool ok = st_->cv.wait_for(lock, timeout, [&] {
      if (st_->failed) return true;
      for (const auto& b : blobs)
        if (!b) return false;
      return true;
    });
    if (st_->failed) std::rethrow_exception(st_->failure_error());
    if (!ok) {
      std::string missing;
      for (size_t r = 0; r < blobs.size(); ++r)
        if (!blobs[r]) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      throw ExecutionError(fmt::format(
          "rank {}: start-up handshake timed out waiting for rank(s) {}", rank_, missing));
    }
    std::vector<std::string> out;
    for (const auto& b : blobs) out.push_back(*b);
    return out;
  }

  void abort(const std::string& reason, int origin) override {
    std::vector<RequestPtr> to_fail;
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      if (st_->failed) return;
      st_->failed = true;
      st_->failed_origin = origin >= 0 ? origin : rank_;
      st_->failed_reason = reason;
      for (auto& [k, r] : st_->waiting) to_fail.push_back(r);
      st_->waiting.clear();
      for (auto& r : st_->in_flight_sends) to_fail.push_back(r);
      st_->in_flight_sends.clear();
      st_->mailbox.clear();
    }
    st_->cv.notify_all();
    for (auto& r : to_fail) r->fail(st_->failure_error());  // one exception object each
  }

  std::optional<std::pair<int, std::string>> failure() const override {
    std::lock_guard<std::mutex> lock(st_->mu);
    if (!st_->failed) return std::nullopt;
    return std::make_pair(st_->failed_origin, st_->failed_reason);
  }

 private:
  std::shared_ptr<LocalHub::State> st_;
  int rank_;
};

}  // namespace

std::unique_ptr<Transport> LocalHub::transport(int rank) {
  if (rank < 0 || rank >= world_)
    throw ConfigError(fmt::format("rank {} is out of range for a hub of {} ranks", rank, world_));
  return std::make_unique<LocalTransport>(state_, rank);
}

}  // namespace baton::runtime
