// Internal (not installed): the Gloo transport's classes, shared by gloo.cc
// (construction and data transfers), gloo_control.cc (control slot:
// heartbeats, aborts, failures) and gloo_mesh.cc (start-up).
#pragma once
#include <gloo/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "baton/runtime.h"
#include "wire.h"

namespace baton::runtime::gloo_detail {

constexpr uint64_t kControlSlot = uint64_t{1} << 62;
using wire::ControlMsg;
using wire::kMsgAbort;
using wire::kMsgBeat;
using wire::kMsgBye;

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

// The full mesh of one rank's Gloo pairs, connected by Baton itself under one
// deadline (gloo_mesh.cc says how).
class MeshContext : public gloo::Context {
 public:
  MeshContext(int r, int n) : gloo::Context(r, n) {}

  void connect(Store& store, const std::string& prefix,
               const std::shared_ptr<gloo::transport::Device>& dev,
               std::chrono::milliseconds timeout, const std::string& host);

  // Longer than any run; transfers never time out inside Gloo.
  static constexpr std::chrono::milliseconds kNoWaitLimit = std::chrono::hours(24 * 365);

 private:
  // "host:port" of a tcp::Address (its own str() prints the port bytes
  // swapped).
  static std::string describe(const std::vector<char>& bytes);
};

// The Gloo transport of one rank (design: gloo.cc's file comment).
class GlooTransport : public Transport {
 public:
  GlooTransport(int rank, int world, std::shared_ptr<Store> store, GlooOptions opts);
  ~GlooTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string kind() const override { return "gloo"; }

  RequestPtr isend(int peer, uint64_t tag, Value v, const std::string& what, Tasks* tasks,
                   int channel, const Layout& layout) override;
  RequestPtr irecv(int peer, uint64_t tag, const std::string& what, Tasks* tasks, int channel,
                   const Layout& layout) override;
  std::vector<std::string> exchange(const std::string& mine,
                                    std::chrono::milliseconds timeout) override;
  void abort(const std::string& reason, int origin) override;
  std::optional<std::pair<int, std::string>> failure() const override;
  std::vector<Silence> silent_peers() const override;
  void release(Tasks* tasks) override;

 private:
  struct Listener {
    int peer;
    std::unique_ptr<ControlMsg> msg;
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
    std::thread thread;
  };
  using Beater = Listener;  // the same parts, sending kMsgBeat to `peer`
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  using Bufs = std::vector<gloo::transport::UnboundBuffer*>;

  // Control slot (gloo_control.cc).
  void beat(Beater& b);
  void stop_beats();
  void listen(Listener& l);
  void send_control(uint32_t kind, int origin, const std::string& text,
                    std::chrono::milliseconds limit);
  void peer_lost(int peer, const std::string& error);
  void abort_transfers();
  bool mark_failed(int origin, const std::string& reason, bool abort_gloo = true);
  std::exception_ptr failure_error_locked() const;

  // Transfers (gloo.cc).
  void check_peer(int peer) const;
  std::shared_ptr<Transfer> start(const RequestPtr& r, Tasks* tasks);
  void finish(const std::shared_ptr<Transfer>& t);
  void spawn(std::function<void()> fn);
  void join_threads(bool all);
  static bool wait_buf(gloo::transport::UnboundBuffer& b, bool is_send);
  void fail_request(const RequestPtr& r, const std::string& what);
  bool post_send(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Value v, Tasks* tasks,
                 const Layout* layout, Bufs& bufs);
  static std::string describe(const Request& r);
  void transfer_error(const RequestPtr& r, std::exception_ptr e);
  void wait_posted(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Tasks* tasks,
                   const Bufs& bufs, bool ok);
  template <class Post>
  void post_then_wait(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Tasks* tasks,
                      bool wait_on_new_thread, Post&& post);
  bool post_recvs(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Bufs& bufs);
  bool post_recv_with_header(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Bufs& bufs);

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

}  // namespace baton::runtime::gloo_detail
