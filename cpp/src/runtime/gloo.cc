// Gloo (TCP) transport.
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
// is bounded as a whole by GlooOptions::connect_timeout (see MeshContext in
// gloo_mesh.cc).
// Every rank also beats on the control slot (one thread per peer, every
// GlooOptions::heartbeat): the time each peer was last heard from tells a
// timed-out rank which peer went silent, which need not be the one it waited
// for (that one may be waiting for the silent one).
//
// This file: the transport's construction and its data transfers; the control
// slot is in gloo_control.cc, start-up in gloo_mesh.cc, the stores in stores.cc.
#include <fmt/format.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>

#include <thread>

#include "gloo_internal.h"

namespace baton::runtime {

namespace gloo_detail {

namespace {

constexpr int kPartBits = 16;

uint64_t slot_of(uint64_t tag, uint64_t part) { return (tag << kPartBits) | part; }

Layout layout_of(const Payload& p) {
  Layout out;
  out.reserve(p.size());
  for (const Tensor& t : p) out.push_back({t.dtype, t.shape});
  return out;
}

}  // namespace

GlooTransport::GlooTransport(int rank, int world, std::shared_ptr<Store> store, GlooOptions opts)
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
    throw ExecutionError(fmt::format("rank {}: gloo could not connect {} ranks (host {}): {}", rank,
                                     world, opts_.hostname, e.what()));
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

GlooTransport::~GlooTransport() {
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

RequestPtr GlooTransport::isend(int peer, uint64_t tag, Value v, const std::string& what,
                                Tasks* tasks, int /*channel*/, const Layout& layout) {
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
  post_then_wait(r, t, tasks, /*wait_on_new_thread=*/true,
                 [&](Bufs& bufs) { return post_send(r, t, std::move(v), tasks, &layout, bufs); });
  return r;
}

RequestPtr GlooTransport::irecv(int peer, uint64_t tag, const std::string& what, Tasks* tasks,
                                int /*channel*/, const Layout& layout) {
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

std::vector<std::string> GlooTransport::exchange(const std::string& mine,
                                                 std::chrono::milliseconds timeout) {
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

void GlooTransport::check_peer(int peer) const {
  if (peer < 0 || peer >= world_ || peer == rank_)
    throw ConfigError(
        fmt::format("rank {}: invalid peer rank {} (world size {})", rank_, peer, world_));
}
// Registers a transfer; returns null (and fails r) when already failed.
std::shared_ptr<Transfer> GlooTransport::start(const RequestPtr& r, Tasks* tasks) {
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

void GlooTransport::finish(const std::shared_ptr<Transfer>& t) {
  std::lock_guard<std::mutex> lock(mu_);
  transfers_.remove(t);
  if (!t->req->done() || failed_) graveyard_.push_back(t);  // see Transfer
  cv_.notify_all();
}

void GlooTransport::release(Tasks* tasks) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(30), [&] {
    for (auto& t : transfers_)
      if (t->tasks == tasks) return false;
    return true;
  });
}

void GlooTransport::spawn(std::function<void()> fn) {
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

void GlooTransport::join_threads(bool all) {
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
bool GlooTransport::wait_buf(gloo::transport::UnboundBuffer& b, bool is_send) {
  return is_send ? b.waitSend() : b.waitRecv();
}

void GlooTransport::fail_request(const RequestPtr& r, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_)
    r->fail(failure_error_locked());
  else
    r->fail(std::make_exception_ptr(ExecutionError(what)));
}
// Converts and posts a send; false when aborted. Throws ExecutionError when
// the value cannot be converted or does not match `layout`, other exceptions
// when Gloo fails. `layout` (the receiver's, when known): the tensors alone
// are sent; otherwise a header (length, meta) comes first.
bool GlooTransport::post_send(const RequestPtr& r, const std::shared_ptr<Transfer>& t, Value v,
                              Tasks* tasks, const Layout* layout, Bufs& bufs) {
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
std::string GlooTransport::describe(const Request& r) {
  return fmt::format("{} of {} {} rank {}", r.is_send ? "send" : "receive", r.what,
                     r.is_send ? "to" : "from", r.peer);
}
// Fails `r` after an exception from posting or waiting (`e`).
void GlooTransport::transfer_error(const RequestPtr& r, std::exception_ptr e) {
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
void GlooTransport::wait_posted(const RequestPtr& r, const std::shared_ptr<Transfer>& t,
                                Tasks* tasks, const Bufs& bufs, bool ok) {
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
void GlooTransport::post_then_wait(const RequestPtr& r, const std::shared_ptr<Transfer>& t,
                                   Tasks* tasks, bool wait_on_new_thread, Post&& post) {
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
bool GlooTransport::post_recvs(const RequestPtr& r, const std::shared_ptr<Transfer>& t,
                               Bufs& bufs) {
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
bool GlooTransport::post_recv_with_header(const RequestPtr& r, const std::shared_ptr<Transfer>& t,
                                          Bufs& bufs) {
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

}  // namespace gloo_detail

std::unique_ptr<Transport> make_gloo_transport(int rank, int world_size,
                                               std::shared_ptr<Store> store, GlooOptions opts) {
  if (!store) throw ConfigError("gloo transport: a rendezvous store is required");
  return std::make_unique<gloo_detail::GlooTransport>(rank, world_size, std::move(store),
                                                      std::move(opts));
}

}  // namespace baton::runtime
