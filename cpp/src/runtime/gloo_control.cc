// The Gloo transport's control slot: heartbeats to every peer, the listener
// of each peer's control messages (abort, bye), and failure bookkeeping
// (first failure wins; pending transfers are aborted).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "gloo_internal.h"

namespace baton::runtime::gloo_detail {

// Sends `b.peer` a beat every heartbeat until stop_beats(). A send waits
// until the peer takes it (a stopped peer: until stop_beats aborts the
// wait); a broken connection ends the beats (the listener reports it).
void GlooTransport::beat(Beater& b) {
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

void GlooTransport::stop_beats() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    beats_stopped_ = true;
  }
  beat_cv_.notify_all();
  for (auto& b : beaters_) b.buf->abortWaitSend();
  for (auto& b : beaters_)
    if (b.thread.joinable()) b.thread.join();
}

void GlooTransport::abort(const std::string& reason, int origin) {
  // Tell the peers first, while every posted Gloo buffer is still intact,
  // then stop our own pending transfers.
  if (!mark_failed(origin >= 0 ? origin : rank_, reason, /*abort_transfers=*/false)) return;
  send_control(kMsgAbort, origin >= 0 ? origin : rank_, reason, std::chrono::seconds(2));
  abort_transfers();
}

std::optional<std::pair<int, std::string>> GlooTransport::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) return std::nullopt;
  return std::make_pair(failed_origin_, failed_reason_);
}

std::vector<Transport::Silence> GlooTransport::silent_peers() const {
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

std::exception_ptr GlooTransport::failure_error_locked() const {
  return std::make_exception_ptr(ExecutionError(
      fmt::format("rank {} failed: {}", failed_origin_, failed_reason_), failed_origin_));
}

void GlooTransport::peer_lost(int peer, const std::string& error) {
  mark_failed(
      peer, fmt::format("connection to rank {} was lost (did the process die?): {}", peer, error));
}

void GlooTransport::abort_transfers() {
  std::list<std::shared_ptr<Transfer>> transfers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    transfers = transfers_;
  }
  for (auto& t : transfers) t->abort();
}
// Returns true when this call set the failure (first failure wins).
bool GlooTransport::mark_failed(int origin, const std::string& reason, bool abort_gloo) {
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

void GlooTransport::send_control(uint32_t kind, int origin, const std::string& text,
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

void GlooTransport::listen(Listener& l) {
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

}  // namespace baton::runtime::gloo_detail
