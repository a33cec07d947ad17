// Gloo (TCP) transport and rendezvous stores.
//
// Every transfer runs on its own short-lived thread (the progress engine for
// this transport): it converts the value to host tensors, then sends a header
// (meta length), the meta (dtypes, shapes) and one message per tensor on
// Gloo slots derived from the tag; the receiver mirrors it. When both ends
// know the value's layout from the plan (Tasks::recv_layout), the header is
// left out: the receiver posts every tensor receive when the RECV is posted
// and the sender sends the tensors alone, so no round trip waits on a thread
// of the receiving process being scheduled. Gloo waits are
// never given a timeout (a Gloo timeout poisons the whole context): the
// executor bounds its own waits and calls abort(), which aborts every pending
// Gloo wait and tells every peer over the control slot. A lost connection on
// the control slot marks that peer failed. Start-up (rendezvous and connect)
// is bounded as a whole by GlooOptions::connect_timeout (see MeshContext).
// Every rank also beats on the control slot (one thread per peer, every
// GlooOptions::heartbeat): the time each peer was last heard from tells a
// timed-out rank which peer went silent, which need not be the one it waited
// for (that one may be waiting for the silent one).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>
#include <sstream>
#include <thread>

#include "baton/runtime.h"
#include "wire.h"

namespace baton::runtime {

// ---------------------------------------------------------------- stores

namespace {

class HashStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return map_.count(key) > 0; }))
      throw ExecutionError(
          fmt::format("store: timed out after {} ms waiting for key '{}'", timeout.count(), key));
    return map_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

class FileStoreWrap : public Store {
 public:
  explicit FileStoreWrap(const std::string& dir) : fs_(dir) {}
  void set(const std::string& key, const std::string& value) override {
    fs_.set(key, std::vector<char>(value.begin(), value.end()));
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      fs_.wait({key}, timeout);
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("store: timed out after {} ms waiting for key '{}': {}",
                                       timeout.count(), key, e.what()));
    }
    auto v = fs_.get(key);
    return std::string(v.begin(), v.end());
  }

 private:
  gloo::rendezvous::FileStore fs_;
};

class CallbackStore : public Store {
 public:
  CallbackStore(std::function<void(const std::string&, const std::string&)> s,
                std::function<std::string(const std::string&, std::chrono::milliseconds)> g)
      : set_(std::move(s)), get_(std::move(g)) {}
  void set(const std::string& key, const std::string& value) override { set_(key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return get_(key, timeout);
  }

 private:
  std::function<void(const std::string&, const std::string&)> set_;
  std::function<std::string(const std::string&, std::chrono::milliseconds)> get_;
};

}  // namespace

std::shared_ptr<Store> make_hash_store() { return std::make_shared<HashStore>(); }
std::shared_ptr<Store> make_file_store(const std::string& dir) {
  return std::make_shared<FileStoreWrap>(dir);
}
std::shared_ptr<Store> make_callback_store(
    std::function<void(const std::string&, const std::string&)> set,
    std::function<std::string(const std::string&, std::chrono::milliseconds)> get) {
  return std::make_shared<CallbackStore>(std::move(set), std::move(get));
}

// ---------------------------------------------------------------- transport

namespace {

constexpr uint64_t kControlSlot = uint64_t{1} << 62;
constexpr int kPartBits = 16;
using wire::ControlMsg;
using wire::kMsgAbort;
using wire::kMsgBye;
using wire::kMsgBeat;

uint64_t slot_of(uint64_t tag, uint64_t part) { return (tag << kPartBits) | part; }

Layout layout_of(const Payload& p) {
  Layout out;
  out.reserve(p.size());
  for (const Tensor& t : p) out.push_back({t.dtype, t.shape});
  return out;
}

// One transfer's Gloo buffers, abortable from another thread.
struct Transfer {
  std::mutex mu;
  bool aborted = false;
  bool is_send = false;
  RequestPtr req;
  Tasks* tasks = nullptr;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs;
  // Memory the Gloo buffers point into; lives as long as the buffers (an
  // aborted transfer is kept until the transport closes: Gloo may still
  // touch a posted buffer).
  uint64_t len = 0;
  std::string meta;
  Payload payload;

  // Registers a buffer; false when the transfer was aborted already.
  bool add(std::unique_ptr<gloo::transport::UnboundBuffer> b) {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted) return false;
    bufs.push_back(std::move(b));
    return true;
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
    for (auto& b : bufs) {
      if (is_send)
        b->abortWaitSend();
      else
        b->abortWaitRecv();
    }
  }
};

// The full mesh of one rank's Gloo pairs, connected by Baton itself rather
// than by gloo::rendezvous::Context::connectFullMesh, whose waits are not
// bounded by the timeout it is given: a pair on the listening side of a
// connection waits five times the context timeout for its peer, and the pairs
// connect one after the other, so one unreachable peer kept a rank waiting for
// minutes. Here the whole start-up, rendezvous and connect, ends by one
// deadline (GlooOptions::connect_timeout from the start of the call):
//   1. join:    every rank sets <prefix>/mesh/join/<rank> and waits (until the
//               deadline) for every other rank's key; ranks that never come are
//               named together.
//   2. address: only now the pairs are created (each pair's connect wait is
//               fixed when it is created, as five times the context timeout,
//               so that timeout is set to a fifth of what is left), and the
//               rank publishes <prefix>/mesh/addr/<rank>: for each peer in rank
//               order, a 4-byte little-endian length and the tcp::Address bytes
//               of its pair for that peer.
//   3. connect: every pair connects on its own thread (no chain of waits
//               between ranks); a pair that fails or times out names its peer.
// Afterwards the transport context timeout is lifted: Gloo uses it as the
// default wait of every unbound buffer, and transfer waits are bounded by the
// executor instead (see the file comment).
class MeshContext : public gloo::Context {
 public:
  MeshContext(int r, int n) : gloo::Context(r, n) {}

  void connect(Store& store, const std::string& prefix,
               const std::shared_ptr<gloo::transport::Device>& dev,
               std::chrono::milliseconds timeout, const std::string& host) {
    using std::chrono::milliseconds;
    const auto deadline = Clock::now() + timeout;
    auto left = [&] {
      // At least 1 ms, so that keys already present are still seen after the
      // deadline and every missing rank is named, not only the first.
      return std::max(milliseconds(1),
                      std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
    };
    const std::string keys = prefix + "/mesh/";
    auto gather = [&](const std::string& what, const std::string& step) {
      std::vector<std::string> got(static_cast<size_t>(size));
      std::vector<int> missing;
      std::string first_error;
      for (int p = 0; p < size; ++p) {
        if (p == rank) continue;
        try {
          got[static_cast<size_t>(p)] = store.get(keys + what + std::to_string(p), left());
        } catch (const std::exception& e) {
          missing.push_back(p);
          if (first_error.empty()) first_error = e.what();
        }
      }
      if (!missing.empty())
        throw ExecutionError(
            fmt::format("rank {}: gloo start-up timed out after {} ms: rank(s) {} {} (store keys "
                        "'{}{}<rank>'; did every rank start, with world size {} and the same "
                        "store?); first store error: {}",
                        rank, timeout.count(), fmt::join(missing, ", "), step, keys, what, size,
                        first_error),
            missing.front());
      return got;
    };

    // 1. join
    store.set(keys + "join/" + std::to_string(rank), "1");
    gather("join/", "never joined");

    // 2. address
    auto tctx = dev->createContext(rank, size);
    tctx->setTimeout(std::max(milliseconds(1), (left() + milliseconds(4)) / 5));
    std::vector<std::vector<char>> pairs;
    for (int p = 0; p < size; ++p)
      if (p != rank) pairs.push_back(tctx->createPair(p)->address().bytes());
    const std::string mine = wire::encode_addresses(pairs);
    store.set(keys + "addr/" + std::to_string(rank), mine);
    const auto blobs = gather("addr/", "joined but published no address");
    std::vector<std::vector<char>> peer_addr(static_cast<size_t>(size));
    for (int p = 0; p < size; ++p) {
      if (p != rank)
        peer_addr[static_cast<size_t>(p)] =
            wire::address_for(blobs[static_cast<size_t>(p)], p, rank, size);
    }

    // 3. connect
    std::vector<std::string> errors(static_cast<size_t>(size));
    std::vector<std::thread> threads;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      threads.emplace_back([&, p] {
        const auto i = static_cast<size_t>(p);
        try {
          tctx->getPair(p)->connect(peer_addr[i]);
        } catch (const std::exception& e) {
          errors[i] = e.what();
          if (errors[i].empty()) errors[i] = "unknown error";
        }
      });
    }
    for (auto& t : threads) t.join();
    std::vector<int> failed;
    std::string details;
    for (int p = 0; p < size; ++p) {
      const auto i = static_cast<size_t>(p);
      if (errors[i].empty()) continue;
      failed.push_back(p);
      details += fmt::format("; rank {} (at {}): {}", p, describe(peer_addr[i]), errors[i]);
    }
    if (!failed.empty())
      throw ExecutionError(
          fmt::format("rank {}: gloo could not connect to rank(s) {} within {} ms (this rank "
                      "advertises host {}; is that address reachable from the other ranks? set "
                      "BATON_HOSTNAME / hostname to an address they can reach){}",
                      rank, fmt::join(failed, ", "), timeout.count(), host, details),
          failed.front());

    tctx->setTimeout(kNoWaitLimit);
    setTimeout(kNoWaitLimit);
    device_ = dev;
    transportContext_ = std::move(tctx);
  }

  // Longer than any run; transfers never time out inside Gloo.
  static constexpr std::chrono::milliseconds kNoWaitLimit = std::chrono::hours(24 * 365);

 private:
  // "host:port" of a tcp::Address (its own str() prints the port bytes
  // swapped).
  static std::string describe(const std::vector<char>& bytes) {
    try {
      const gloo::transport::tcp::Address addr(bytes);
      sockaddr_storage ss{};
      std::memcpy(&ss, &addr.getSockaddr(), sizeof(ss));
      char host[INET6_ADDRSTRLEN] = {};
      if (ss.ss_family == AF_INET) {
        const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        return fmt::format("{}:{}", host, ntohs(a->sin_port));
      }
      if (ss.ss_family == AF_INET6) {
        const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
      }
    } catch (const std::exception&) {
      // fall through
    }
    return "an unreadable address";
  }
};

class GlooTransport : public Transport {
 public:
  GlooTransport(int rank, int world, std::shared_ptr<Store> store, GlooOptions opts)
      : rank_(rank), world_(world), store_(std::move(store)), opts_(std::move(opts)) {
    if (world < 1 || rank < 0 || rank >= world)
      throw ConfigError(
          fmt::format("gloo transport: rank {} is invalid for world size {}", rank, world));
    gloo::transport::tcp::attr attr;
    attr.hostname = opts_.hostname;
    try {
      dev_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<MeshContext>(rank, world);
      ctx->connect(*store_, opts_.prefix, dev_, opts_.connect_timeout, opts_.hostname);
      ctx_ = std::move(ctx);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("rank {}: gloo could not connect {} ranks (host {}): {}",
                                       rank, world, opts_.hostname, e.what()));
    }
    bye_.assign(static_cast<size_t>(world), false);
    bye_[static_cast<size_t>(rank)] = true;
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      auto msg = std::make_unique<ControlMsg>();
      auto buf = ctx_->createUnboundBuffer(msg.get(), sizeof(ControlMsg));
      listeners_.push_back(Listener{p, std::move(msg), std::move(buf), {}});
    }
    heard_.assign(static_cast<size_t>(world), Clock::now());
    for (auto& l : listeners_) l.thread = std::thread([this, &l] { listen(l); });
    if (opts_.heartbeat.count() > 0) {
      for (int p = 0; p < world; ++p) {
        if (p == rank) continue;
        auto msg = std::make_unique<ControlMsg>();
        msg->kind = kMsgBeat;
        msg->origin = rank;
        auto buf = ctx_->createUnboundBuffer(msg.get(), sizeof(ControlMsg));
        beaters_.push_back(Beater{p, std::move(msg), std::move(buf), {}});
      }
      for (auto& b : beaters_) b.thread = std::thread([this, &b] { beat(b); });
    }
  }

  ~GlooTransport() override {
    stop_beats();  // no beat may follow the bye
    bool failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      failed = failed_;
    }
    if (!failed) {
      // Tell every peer that we leave normally before our sockets close, so
      // that none of them mistakes the closed connection for a failure.
      send_control(kMsgBye, rank_, "bye", std::chrono::seconds(5));
    }
    for (auto& l : listeners_) l.buf->abortWaitRecv();
    for (auto& l : listeners_)
      if (l.thread.joinable()) l.thread.join();
    std::list<std::shared_ptr<Transfer>> transfers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      transfers = transfers_;
    }
    for (auto& t : transfers) t->abort();
    join_threads(true);
    // Close every connection before freeing buffers that Gloo may still have
    // posted (aborted transfers, listeners): after close() no pair touches them.
    try {
      ctx_->closeConnections();
    } catch (const std::exception&) {
      // already broken: nothing left to close
    }
    graveyard_.clear();
    transfers_.clear();
    listeners_.clear();
    beaters_.clear();
    ctx_.reset();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string kind() const override { return "gloo"; }

  RequestPtr isend(int peer, uint64_t tag, Value v, const std::string& what, Tasks* tasks,
                   int /*channel*/, const Layout& layout) override {
    check_peer(peer);
    auto r = std::make_shared<Request>(true, peer, tag, what);
    auto t = start(r, tasks);
    if (!t) return r;
    if (layout.empty() || opts_.delay.count() > 0) {
      spawn([this, r, t, v = std::move(v), tasks, layout]() mutable {
        post_then_wait(r, t, tasks, /*wait_on_new_thread=*/false, [&](Bufs& bufs) {
          return post_send(r, t, std::move(v), tasks, layout.empty() ? nullptr : &layout, bufs);
        });
      });
      return r;
    }
    // Known layout: converted and posted here, on the caller's thread (the
    // executor, right after the producing task), so the data leaves at once
    // instead of when a new thread gets the core; a thread only waits.
    post_then_wait(r, t, tasks, /*wait_on_new_thread=*/true, [&](Bufs& bufs) {
      return post_send(r, t, std::move(v), tasks, &layout, bufs);
    });
    return r;
  }

  RequestPtr irecv(int peer, uint64_t tag, const std::string& what, Tasks* tasks, int /*channel*/,
                   const Layout& layout) override {
    check_peer(peer);
    auto r = std::make_shared<Request>(false, peer, tag, what);
    auto t = start(r, tasks);
    if (!t) return r;
    if (layout.empty()) {
      spawn([this, r, t, tasks] {
        post_then_wait(r, t, tasks, /*wait_on_new_thread=*/false,
                       [&](Bufs& bufs) { return post_recv_with_header(r, t, bufs); });
      });
      return r;
    }
    // Known layout: the tensor receives are posted here, on the caller's
    // thread, so the sender's data moves as soon as it is sent; a thread only
    // waits for them and converts.
    post_then_wait(r, t, tasks, /*wait_on_new_thread=*/true, [&](Bufs& bufs) {
      r->mark_started();
      for (const TensorSpec& spec : layout)
        t->payload.push_back(alloc_host_tensor(spec.dtype, spec.shape));
      return post_recvs(r, t, bufs);
    });
    return r;
  }

  std::vector<std::string> exchange(const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    const int round = round_++;
    const std::string base = fmt::format("{}/exchange/{}/", opts_.prefix, round);
    store_->set(base + std::to_string(rank_), mine);
    std::vector<std::string> out;
    for (int r = 0; r < world_; ++r) {
      try {
        out.push_back(r == rank_ ? mine : store_->get(base + std::to_string(r), timeout));
      } catch (const std::exception& e) {
        throw ExecutionError(
            fmt::format("rank {}: start-up handshake: no answer from rank {} within {} ms ({})",
                        rank_, r, timeout.count(), e.what()));
      }
    }
    return out;
  }

  void abort(const std::string& reason, int origin) override {
    // Tell the peers first, while every posted Gloo buffer is still intact,
    // then stop our own pending transfers.
    if (!mark_failed(origin >= 0 ? origin : rank_, reason, /*abort_transfers=*/false)) return;
    send_control(kMsgAbort, origin >= 0 ? origin : rank_, reason, std::chrono::seconds(2));
    abort_transfers();
  }

  std::optional<std::pair<int, std::string>> failure() const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) return std::nullopt;
    return std::make_pair(failed_origin_, failed_reason_);
  }

  std::vector<Silence> silent_peers() const override {
    std::vector<Silence> out;
    if (opts_.heartbeat.count() <= 0) return out;
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int p = 0; p < world_; ++p) {
        const auto quiet = now - heard_[static_cast<size_t>(p)];
        if (p == rank_ || bye_[static_cast<size_t>(p)] || quiet <= 3 * opts_.heartbeat) continue;
        out.push_back({p, std::chrono::duration<double>(quiet).count()});
      }
    }
    std::sort(out.begin(), out.end(),
              [](const Silence& a, const Silence& b) { return a.seconds > b.seconds; });
    return out;
  }

 private:
  struct Listener {
    int peer;
    std::unique_ptr<ControlMsg> msg;
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
    std::thread thread;
  };
  using Beater = Listener;  // the same parts, sending kMsgBeat to `peer`

  // Sends `b.peer` a beat every heartbeat until stop_beats(). A send waits
  // until the peer takes it (a stopped peer: until stop_beats aborts the
  // wait); a broken connection ends the beats (the listener reports it).
  void beat(Beater& b) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!beats_stopped_) {
      lock.unlock();
      bool ok = false;
      try {
        b.buf->send(b.peer, kControlSlot);
        ok = b.buf->waitSend();
      } catch (const std::exception&) {
        ok = false;
      }
      lock.lock();
      if (!ok) return;
      beat_cv_.wait_for(lock, opts_.heartbeat, [&] { return beats_stopped_; });
    }
  }

  void stop_beats() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      beats_stopped_ = true;
    }
    beat_cv_.notify_all();
    for (auto& b : beaters_) b.buf->abortWaitSend();
    for (auto& b : beaters_)
      if (b.thread.joinable()) b.thread.join();
  }

  void check_peer(int peer) const {
    if (peer < 0 || peer >= world_ || peer == rank_)
      throw ConfigError(
          fmt::format("rank {}: invalid peer rank {} (world size {})", rank_, peer, world_));
  }

  std::exception_ptr failure_error_locked() const {
    return std::make_exception_ptr(ExecutionError(
        fmt::format("rank {} failed: {}", failed_origin_, failed_reason_), failed_origin_));
  }

  // Registers a transfer; returns null (and fails r) when already failed.
  std::shared_ptr<Transfer> start(const RequestPtr& r, Tasks* tasks) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) {
      r->fail(failure_error_locked());
      return nullptr;
    }
    auto t = std::make_shared<Transfer>();
    t->is_send = r->is_send;
    t->req = r;
    t->tasks = tasks;
    transfers_.push_back(t);
    return t;
  }

  void finish(const std::shared_ptr<Transfer>& t) {
    std::lock_guard<std::mutex> lock(mu_);
    transfers_.remove(t);
    if (!t->req->done() || failed_) graveyard_.push_back(t);  // see Transfer
    cv_.notify_all();
  }

 public:
  void release(Tasks* tasks) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(30), [&] {
      for (auto& t : transfers_)
        if (t->tasks == tasks) return false;
      return true;
    });
  }

 private:
  void spawn(std::function<void()> fn) {
    join_threads(false);
    std::lock_guard<std::mutex> lock(threads_mu_);
    auto done = std::make_shared<std::atomic<bool>>(false);
    // Everything the job holds (values, payloads: their release may need the
    // Python GIL) is dropped before the thread reports done, so joining a done
    // thread never waits on the GIL.
    threads_.push_back({std::thread([fn = std::move(fn), done]() mutable {
                          fn();
                          fn = nullptr;
                          done->store(true);
                        }),
                        done});
  }

  void join_threads(bool all) {
    std::list<Worker> finished;
    {
      std::lock_guard<std::mutex> lock(threads_mu_);
      for (auto it = threads_.begin(); it != threads_.end();) {
        if (all || it->done->load()) {
          finished.push_back(std::move(*it));
          it = threads_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& w : finished) w.thread.join();
  }

  // Waits on one Gloo buffer; false when aborted. Throws on Gloo errors.
  static bool wait_buf(gloo::transport::UnboundBuffer& b, bool is_send) {
    return is_send ? b.waitSend() : b.waitRecv();
  }

  void fail_request(const RequestPtr& r, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_)
      r->fail(failure_error_locked());
    else
      r->fail(std::make_exception_ptr(ExecutionError(what)));
  }

  using Bufs = std::vector<gloo::transport::UnboundBuffer*>;

  // Converts and posts a send; false when aborted. Throws ExecutionError when
  // the value cannot be converted or does not match `layout`, other exceptions
  // when Gloo fails. `layout` (the receiver's, when known): the tensors alone
  // are sent; otherwise a header (length, meta) comes first.
  bool post_send(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Value v, Tasks* tasks,
                 const Layout* layout, Bufs& bufs) {
    r->mark_started();
    if (opts_.delay.count() > 0) std::this_thread::sleep_for(opts_.delay);
    t->payload = tasks->to_payload(v);
    v.reset();
    const Payload& p = t->payload;
    if (layout != nullptr) {
      const std::string bad = layout_mismatch(p, *layout);
      if (!bad.empty()) throw ExecutionError(bad);
    } else {
      t->meta = wire::encode_meta(layout_of(t->payload));
      t->len = t->meta.size();
    }
    auto post = [&](void* ptr, size_t n, uint64_t part) {
      auto b = ctx_->createUnboundBuffer(ptr, n);
      auto* raw = b.get();
      if (!t->add(std::move(b))) return false;
      raw->send(r->peer, slot_of(r->tag, part));
      bufs.push_back(raw);
      return true;
    };
    bool ok = layout != nullptr ||
              (post(&t->len, sizeof(t->len), 0) && post(t->meta.data(), t->meta.size(), 1));
    for (size_t i = 0; ok && i < p.size(); ++i)
      if (p[i].nbytes > 0) ok = post(p[i].data, p[i].nbytes, 2 + i);
    return ok;
  }

  // "send of act(s0,m1) to rank 1", "receive of ... from rank 0".
  static std::string describe(const Request& r) {
    return fmt::format("{} of {} {} rank {}", r.is_send ? "send" : "receive", r.what,
                       r.is_send ? "to" : "from", r.peer);
  }

  // Fails `r` after an exception from posting or waiting (`e`).
  void transfer_error(const RequestPtr& r, std::exception_ptr e) {
    const std::string what = describe(*r);
    try {
      std::rethrow_exception(e);
    } catch (const ExecutionError& x) {  // conversion of the value, layout mismatch
      fail_request(r, fmt::format("{} failed: {}", what, x.what()));
    } catch (const std::exception& x) {  // Gloo: the connection to the peer broke
      peer_lost(r->peer, x.what());
      fail_request(r, fmt::format("{} failed: {}", what, x.what()));
    }
  }

  // Waits for the posted `bufs` of a transfer (`ok` false: aborted while
  // posting), completes `r` (a receive with its converted payload) and
  // retires the transfer.
  void wait_posted(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Tasks* tasks,
                   const Bufs& bufs, bool ok) {
    try {
      for (auto* b : bufs)
        if (ok) ok = wait_buf(*b, r->is_send);
      if (!ok) {
        fail_request(r, describe(*r) + " was aborted");
      } else if (r->is_send) {
        r->complete();
      } else {
        r->complete(tasks->from_payload(std::move(t->payload)));
        t->payload.clear();
      }
    } catch (const std::exception&) {
      transfer_error(r, std::current_exception());
    }
    finish(t);
  }

  // Posts a transfer's Gloo buffers with `post` (into `bufs`; false: aborted),
  // then waits for them (wait_posted) on a new thread or on this one. A failure
  // while posting fails the request and retires the transfer.
  template <class Post>
  void post_then_wait(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Tasks* tasks,
                      bool wait_on_new_thread, Post&& post) {
    Bufs bufs;
    bool ok = false;
    try {
      ok = post(bufs);
    } catch (const std::exception&) {
      transfer_error(r, std::current_exception());
      finish(t);
      return;
    }
    if (wait_on_new_thread)
      spawn([this, r, t, tasks, bufs, ok] { wait_posted(r, t, tasks, bufs, ok); });
    else
      wait_posted(r, t, tasks, bufs, ok);
  }

  // Posts a receive for every non-empty tensor of t->payload; false when the
  // transfer was aborted.
  bool post_recvs(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Bufs& bufs) {
    for (size_t i = 0; i < t->payload.size(); ++i) {
      Tensor& x = t->payload[i];
      if (x.nbytes == 0) continue;
      auto b = ctx_->createUnboundBuffer(x.data, x.nbytes);
      auto* raw = b.get();
      if (!t->add(std::move(b))) return false;
      raw->recv(r->peer, slot_of(r->tag, 2 + i));
      bufs.push_back(raw);
    }
    return true;
  }

  // A receive with a header: reads its length and its meta (dtypes, shapes),
  // then posts the tensors; false when aborted.
  bool post_recv_with_header(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Bufs& bufs) {
    auto recv_one = [&](void* ptr, size_t n, uint64_t part) {
      auto b = ctx_->createUnboundBuffer(ptr, n);
      auto* raw = b.get();
      if (!t->add(std::move(b))) return false;
      raw->recv(r->peer, slot_of(r->tag, part));
      return wait_buf(*raw, false);
    };
    if (!recv_one(&t->len, sizeof(t->len), 0)) return false;
    r->mark_started();
    wire::check_meta_len(t->len, r->peer);
    t->meta.assign(t->len, '\0');
    if (!recv_one(t->meta.data(), t->meta.size(), 1)) return false;
    for (const TensorSpec& spec : wire::decode_meta(t->meta, r->peer))
      t->payload.push_back(alloc_host_tensor(spec.dtype, spec.shape));
    return post_recvs(r, t, bufs);  // every tensor posted before waiting on any
  }

  void peer_lost(int peer, const std::string& error) {
    mark_failed(peer, fmt::format("connection to rank {} was lost (did the process die?): {}", peer,
                                  error));
  }

  // Returns true when this call set the failure (first failure wins).
  void abort_transfers() {
    std::list<std::shared_ptr<Transfer>> transfers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      transfers = transfers_;
    }
    for (auto& t : transfers) t->abort();
  }

  bool mark_failed(int origin, const std::string& reason, bool abort_gloo = true) {
    std::list<std::shared_ptr<Transfer>> transfers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_) return false;
      failed_ = true;
      failed_origin_ = origin;
      failed_reason_ = reason;
      transfers = transfers_;
    }
    cv_.notify_all();
    for (auto& t : transfers) {
      std::exception_ptr e;
      {
        std::lock_guard<std::mutex> lock(mu_);
        e = failure_error_locked();  // one exception object per request
      }
      t->req->fail(e);
    }
    if (abort_gloo) abort_transfers();
    return true;
  }

  void send_control(uint32_t kind, int origin, const std::string& text,
                    std::chrono::milliseconds limit) {
    std::vector<std::unique_ptr<ControlMsg>> msgs;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      auto m = std::make_unique<ControlMsg>();
      m->kind = kind;
      m->origin = origin;
      std::strncpy(m->text, text.c_str(), sizeof(m->text) - 1);
      try {
        auto b = ctx_->createUnboundBuffer(m.get(), sizeof(ControlMsg));
        b->send(p, kControlSlot);
        bufs.push_back(std::move(b));
        msgs.push_back(std::move(m));
      } catch (const std::exception&) {
        // peer unreachable: nothing to tell
      }
    }
    // Bounded wait; a peer that is gone cannot be told anyway.
    const auto deadline = Clock::now() + limit;
    for (auto& b : bufs) {
      std::thread aborter;
      std::atomic<bool> finished{false};
      auto* raw = b.get();
      aborter = std::thread([&] {
        while (!finished.load() && Clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (!finished.load()) raw->abortWaitSend();
      });
      try {
        raw->waitSend();
      } catch (const std::exception&) {
        // the peer is gone: nothing to tell it
      }
      finished.store(true);
      aborter.join();
    }
  }

  void listen(Listener& l) {
    for (;;) {
      bool ok = false;
      std::string error;
      try {
        l.buf->recv(l.peer, kControlSlot);
        ok = l.buf->waitRecv();
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (!ok) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (closing_ || bye_[static_cast<size_t>(l.peer)]) {
            bye_[static_cast<size_t>(l.peer)] = true;
            cv_.notify_all();
            return;
          }
        }
        if (error.empty()) return;  // aborted
        peer_lost(l.peer, error);
        return;
      }
      const wire::Control m = wire::decode_control(*l.msg, l.peer, world_);
      {
        std::lock_guard<std::mutex> lock(mu_);
        heard_[static_cast<size_t>(l.peer)] = Clock::now();
      }
      if (m.kind == kMsgBye) {
        std::lock_guard<std::mutex> lock(mu_);
        bye_[static_cast<size_t>(l.peer)] = true;
        cv_.notify_all();
        return;
      }
      if (m.kind == kMsgAbort) mark_failed(m.origin, m.text);
    }
  }

  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  int rank_, world_;
  std::shared_ptr<Store> store_;
  GlooOptions opts_;
  std::shared_ptr<gloo::transport::Device> dev_;
  std::shared_ptr<gloo::Context> ctx_;
  std::list<Listener> listeners_;
  std::list<Beater> beaters_;
  mutable std::mutex mu_;
  std::condition_variable cv_, beat_cv_;
  bool failed_ = false, closing_ = false, beats_stopped_ = false;
  std::vector<Clock::time_point> heard_;  // when each peer was last heard from
  int failed_origin_ = -1;
  std::string failed_reason_;
  std::vector<bool> bye_;
  std::list<std::shared_ptr<Transfer>> transfers_;
  std::list<std::shared_ptr<Transfer>> graveyard_;
  std::mutex threads_mu_;
  std::list<Worker> threads_;
  int round_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_gloo_transport(int rank, int world_size,
                                               std::shared_ptr<Store> store, GlooOptions opts) {
  if (!store) throw ConfigError("gloo transport: a rendezvous store is required");
  return std::make_unique<GlooTransport>(rank, world_size, std::move(store), std::move(opts));
}

}  // namespace baton::runtime
