// NCCL point-to-point transport (built only when CUDA and nccl.h are found).
//
// NCCL is loaded with dlopen at run time (nccl_api.h: the copy JAX already
// mapped when there is one, else $BATON_NCCL_LIBRARY, libnccl.so.2; its
// version checked against nccl.h), never linked, so one copy serves both.
// Communicators are non-blocking: setup polls them under a deadline, and no
// NCCL call holds nccl_mu_ while waiting for a peer (abort_comms needs it).
//
// One progress thread issues the posted operations in order, one
// communication group (as ended by flush()) at a time, on its own stream, as
// one ncclGroupStart/End that is waited for: the executor's compute goes on
// meanwhile, and the transfers progress exactly as in the verifier's blocking
// model. NCCL sends no header: receives are sized from the buffer's layout
// (Tasks::recv_layout), so sender and receiver must agree on it. Each channel
// (buffer kind) has its own communicator, so traffic is FIFO per kind, as in
// the verifier's Fifo model. Waits poll the stream and the abort flag; abort() calls
// ncclCommAbort (each communicator is aborted or destroyed exactly once) and
// writes the failure into the store, which a watcher thread on every rank
// polls. Receive buffers come from a pool by byte size (RecvPool): a received
// tensor returns its buffer when released, so steady state allocates nothing.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "baton/nccl_library.h"
#include "baton/runtime.h"
#include "nccl_api.h"

namespace baton::runtime {

namespace nccl_detail {

const NcclApi& nccl_api() {
  static const NcclApi api = [] {
    NcclApi a;
    const std::vector<std::string> mapped = nccl_library::mapped("libnccl");
    for (const nccl_library::Candidate& c :
         nccl_library::load_order(mapped, std::getenv("BATON_NCCL_LIBRARY"))) {
      // A mapped copy is only looked up (RTLD_NOLOAD): never a second copy.
      a.lib = dlopen(c.path.c_str(), RTLD_NOW | RTLD_GLOBAL | (c.mapped ? RTLD_NOLOAD : 0));
      if (a.lib) {
        a.was_mapped = c.mapped;
        break;
      }
      const char* why = dlerror();
      a.error += fmt::format("{}{}: {}", a.error.empty() ? "" : "; ", c.path, why ? why : "?");
    }
    if (!a.lib) return a;
    a.error.clear();
    auto sym = [&](auto& fn, const char* n) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(a.lib, n));
      if (!fn && a.error.empty()) a.error = fmt::format("symbol {} missing from NCCL", n);
    };
    sym(a.GetVersion, "ncclGetVersion");
    sym(a.GetUniqueId, "ncclGetUniqueId");
    sym(a.CommInitRankConfig, "ncclCommInitRankConfig");
    sym(a.CommFinalize, "ncclCommFinalize");
    sym(a.CommDestroy, "ncclCommDestroy");
    sym(a.CommAbort, "ncclCommAbort");
    sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(a.Send, "ncclSend");
    sym(a.Recv, "ncclRecv");
    sym(a.GroupStart, "ncclGroupStart");
    sym(a.GroupEnd, "ncclGroupEnd");
    sym(a.GetErrorString, "ncclGetErrorString");
    if (a.GetVersion) {
      Dl_info info{};
      if (dladdr(reinterpret_cast<void*>(a.GetVersion), &info) && info.dli_fname)
        a.path = info.dli_fname;
      if (a.GetVersion(&a.version) != ncclSuccess) a.error = "ncclGetVersion failed";
    }
    if (a.error.empty()) a.error = nccl_library::version_mismatch(a.version, NCCL_VERSION_CODE);
    if (a.error.empty() && nccl_library::mapped("libnccl").size() > 1)
      a.error = fmt::format("several NCCL libraries are mapped into this process ({}); Baton "
                            "uses one copy, the one JAX loaded",
                            fmt::join(nccl_library::mapped("libnccl"), ", "));
    if (!a.error.empty()) {
      a.error += fmt::format(" (library {})", a.path.empty() ? "?" : a.path);
      a.lib = nullptr;
      return a;
    }
    if (std::getenv("BATON_QUIET") == nullptr)
      std::fprintf(stderr, "baton: NCCL %s from %s (%s)\n",
                   nccl_library::version_string(a.version).c_str(), a.path.c_str(),
                   a.was_mapped ? "the copy already mapped by the process" : "loaded by Baton");
    return a;
  }();
  return api;
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw ExecutionError(fmt::format("CUDA error in {}: {}", what, cudaGetErrorString(e)));
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw ExecutionError(fmt::format("NCCL error in {}: {}", what, nccl_api().GetErrorString(r)));
}

bool accepted(ncclResult_t r, const char* what) {
  if (r == ncclInProgress) return true;
  nccl_check(r, what);
  return true;
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

void wait_ready(const std::vector<ncclComm_t>& comms, Clock::time_point deadline,
                const std::function<std::string(size_t)>& describe, const std::string& doing,
                std::mutex* mu, const std::function<bool()>& gone) {
  const NcclApi& api = nccl_api();
  std::vector<bool> ready(comms.size(), false);
  size_t left = comms.size();
  for (int spins = 0; left > 0; ++spins) {
    for (size_t i = 0; i < comms.size(); ++i) {
      if (ready[i]) continue;
      ncclResult_t r = ncclSuccess;
      {
        std::unique_lock<std::mutex> lock;
        if (mu) lock = std::unique_lock<std::mutex>(*mu);
        if (gone && gone())
          throw ExecutionError(fmt::format("{}: the NCCL communicators were aborted", doing));
        const ncclResult_t q = api.CommGetAsyncError(comms[i], &r);
        if (q != ncclSuccess) r = q;
      }
      if (r == ncclInProgress) continue;
      if (r != ncclSuccess)
        throw ExecutionError(fmt::format("{}: NCCL error on {}: {}", doing, describe(i),
                                         api.GetErrorString(r)));
      ready[i] = true;
      --left;
    }
    if (left == 0) break;
    if (Clock::now() > deadline) {
      size_t first = 0;
      while (ready[first]) ++first;
      throw ExecutionError(fmt::format(
          "{}: {} did not finish by the deadline ({} of {} communicators still in progress; "
          "the peer never arrived or is stuck: communicators aborted)",
          doing, describe(first), left, comms.size()));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 20 : 500));
  }
}

}  // namespace nccl_detail

namespace {

using nccl_detail::accepted;
using nccl_detail::cuda_check;
using nccl_detail::nccl_api;
using nccl_detail::nccl_check;
using nccl_detail::NcclApi;

// Receive buffers, reused by byte size: a received tensor's owner returns its
// buffer here (not cudaFree) when released, so steady-state receives allocate
// nothing. A view handed to JAX is released by PJRT only after the work using
// it completed, so a returned buffer is free to receive into again. Buffers
// are freed when the pool goes (the transport and every received tensor).
class RecvPool : public std::enable_shared_from_this<RecvPool> {
 public:
  explicit RecvPool(int device) : device_(device) {}
  ~RecvPool() {
    for (auto& [n, list] : free_)
      for (void* p : list) cudaFree(p);
  }
  // A buffer of `n` bytes (n > 0) owned by the returned pointer.
  std::shared_ptr<void> take(size_t n) {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(n);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
      }
    }
    if (p == nullptr) {
      cuda_check(cudaSetDevice(device_), "cudaSetDevice");
      cuda_check(cudaMalloc(&p, n), "cudaMalloc (NCCL receive buffer)");
    }
    std::shared_ptr<RecvPool> self = shared_from_this();
    return std::shared_ptr<void>(p, [self, n](void* q) { self->give(q, n); });
  }

 private:
  void give(void* p, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[n].push_back(p);
  }
  const int device_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
};

struct Op {
  RequestPtr req;
  Value value;  // send
  Tasks* tasks = nullptr;
  int channel = 0;
  bool flush = false;  // group marker
  Layout layout;       // the receiver's (a send checks its value against it)
  Payload payload;
};

class NcclTransport : public Transport {
 public:
  NcclTransport(int rank, int world, int device, std::shared_ptr<Store> store,
                TransportOptions opts, int channels)
      : rank_(rank), world_(world), device_(device), store_(std::move(store)), opts_(opts) {
    const NcclApi& api = nccl_api();
    if (!api.lib) throw ConfigError(fmt::format("cannot load NCCL: {}", api.error));
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    // One communicator per channel, created in the same order on every rank;
    // non-blocking (nccl_api.h), so setup waits for the peers under a deadline
    // instead of blocking in ncclCommInitRank.
    const auto setup = std::chrono::seconds(60);
    const auto deadline = Clock::now() + setup;
    try {
      for (int c = 0; c < channels; ++c) {
        ncclUniqueId id;
        const std::string key = fmt::format("baton/nccl/id/{}", c);
        if (rank == 0) {
          nccl_check(api.GetUniqueId(&id), "ncclGetUniqueId");
          store_->set(key, std::string(reinterpret_cast<char*>(&id), sizeof(id)));
        } else {
          const std::string v = store_->get(key, setup);
          if (v.size() != sizeof(id)) throw ExecutionError("malformed NCCL unique id in the store");
          std::memcpy(&id, v.data(), sizeof(id));
        }
        ncclConfig_t cfg = nccl_detail::nonblocking_config();
        ncclComm_t comm = nullptr;
        accepted(api.CommInitRankConfig(&comm, world, id, rank, &cfg), "ncclCommInitRankConfig");
        comms_.push_back(comm);
      }
      nccl_detail::wait_ready(
          comms_, deadline,
          [&](size_t i) {
            return fmt::format("the communicator of channel {} (rank {} of {})", i, rank, world);
          },
          fmt::format("rank {}: NCCL transport setup", rank));
    } catch (...) {
      for (ncclComm_t c : comms_)
        if (c) api.CommAbort(c);
      comms_.clear();
      throw;
    }
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    pool_ = std::make_shared<RecvPool>(device);
    worker_ = std::thread([this] { loop(); });
    watcher_ = std::thread([this] { watch(); });
  }

  ~NcclTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    watcher_.join();
    // Each communicator is aborted (mark_failed) or destroyed here, never both.
    if (!aborted_comm_.exchange(true))
      for (ncclComm_t c : comms_) nccl_api().CommDestroy(c);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string kind() const override { return "nccl"; }

  RequestPtr isend(int peer, uint64_t tag, Value v, const std::string& what, Tasks* tasks,
                   int channel, const Layout& layout) override {
    auto r = std::make_shared<Request>(true, peer, tag, what);
    Op op{r, std::move(v), tasks, channel};
    op.layout = layout;
    enqueue(std::move(op));
    return r;
  }
  RequestPtr irecv(int peer, uint64_t tag, const std::string& what, Tasks* tasks, int channel,
                   const Layout& layout) override {
    auto r = std::make_shared<Request>(false, peer, tag, what);
    if (layout.empty()) {
      r->fail(std::make_exception_ptr(ConfigError(fmt::format(
          "rank {}: the NCCL receive of {} from rank {} needs the buffer's layout (dtypes and "
          "shapes: Tasks::recv_layout, or layout= in Python); NCCL carries no header",
          rank_, what, peer))));
      return r;
    }
    Op op{r, nullptr, tasks, channel};
    op.layout = layout;
    enqueue(std::move(op));
    return r;
  }
  void flush() override {
    Op m;
    m.flush = true;
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(m));
    cv_.notify_all();
  }

  std::vector<std::string> exchange(const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    const int round = round_++;
    const std::string base = fmt::format("baton/nccl/exchange/{}/", round);
    store_->set(base + std::to_string(rank_), mine);
    std::vector<std::string> out;
    for (int r = 0; r < world_; ++r)
      out.push_back(r == rank_ ? mine : store_->get(base + std::to_string(r), timeout));
    return out;
  }

  void abort(const std::string& reason, int origin) override {
    const int o = origin >= 0 ? origin : rank_;
    if (!mark_failed(o, reason)) return;
    try {
      store_->set("baton/nccl/abort", fmt::format("{}|{}", o, reason));
    } catch (const std::exception&) {
    }
  }

  std::optional<std::pair<int, std::string>> failure() const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) return std::nullopt;
    return std::make_pair(failed_origin_, failed_reason_);
  }

 private:
  void enqueue(Op op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (op.req->peer < 0 || op.req->peer >= world_) {
      op.req->fail(
          std::make_exception_ptr(ConfigError(fmt::format("invalid peer {}", op.req->peer))));
      return;
    }
    if (op.channel < 0 || op.channel >= static_cast<int>(comms_.size())) {
      op.req->fail(std::make_exception_ptr(ConfigError(fmt::format(
          "{}: channel {} but the NCCL transport opened {} (one per transferred buffer kind)",
          op.req->what, op.channel, comms_.size()))));
      return;
    }
    if (failed_) {
      op.req->fail(error_locked());
      return;
    }
    queue_.push_back(std::move(op));
    cv_.notify_all();
  }

  std::exception_ptr error_locked() const {
    return std::make_exception_ptr(ExecutionError(
        fmt::format("rank {} failed: {}", failed_origin_, failed_reason_), failed_origin_));
  }

  bool mark_failed(int origin, const std::string& reason) {
    std::vector<RequestPtr> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_) return false;
      failed_ = true;
      failed_origin_ = origin;
      failed_reason_ = reason;
      for (auto& op : queue_)
        if (op.req) pending.push_back(op.req);
      for (auto& r : in_flight_) pending.push_back(r);
    }
    cv_.notify_all();
    abort_comms();
    for (auto& r : pending) {
      std::exception_ptr e;
      {
        std::lock_guard<std::mutex> lock(mu_);
        e = error_locked();  // one exception object per request
      }
      r->fail(e);
    }
    return true;
  }

  // Aborts every communicator exactly once (also against the destructor's
  // ncclCommDestroy). Under nccl_mu_, so no NCCL call of the worker uses a
  // communicator while it is freed.
  void abort_comms() {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    if (aborted_comm_.exchange(true)) return;
    for (ncclComm_t c : comms_) nccl_api().CommAbort(c);
  }

  // Waits for the stream; false when the transport failed or is closing meanwhile.
  // Waits for the group just issued: first until NCCL has enqueued it (a
  // non-blocking communicator reports ncclInProgress until then, and the stream
  // may look idle meanwhile), then for the stream. False when the transport
  // failed or is closing meanwhile.
  bool sync() {
    bool enqueued = false;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed_ || stop_) return false;
      }
      {
        std::lock_guard<std::mutex> lock(nccl_mu_);
        if (aborted_comm_) return false;
        bool pending = false;
        for (ncclComm_t c : comms_) {
          ncclResult_t async = ncclSuccess;
          nccl_api().CommGetAsyncError(c, &async);
          if (async == ncclInProgress)
            pending = true;
          else
            nccl_check(async, "NCCL (asynchronous)");
        }
        enqueued = enqueued || !pending;
      }
      if (enqueued) {
        const cudaError_t q = cudaStreamQuery(stream_);
        if (q == cudaSuccess) return true;
        if (q != cudaErrorNotReady) cuda_check(q, "cudaStreamQuery");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // One communication group: every operation is issued inside one
  // ncclGroupStart/End, exactly the blocking model the verifier checks.
  void run_group(std::vector<Op>& ops) {
    const NcclApi& api = nccl_api();
    for (auto& op : ops) {
      op.req->mark_started();
      if (op.req->is_send) {
        op.payload = op.tasks->to_payload(op.value);
        op.value.reset();
        if (!op.layout.empty()) {
          const std::string bad = layout_mismatch(op.payload, op.layout);
          if (!bad.empty())
            throw ExecutionError(fmt::format("NCCL send of {} to rank {}: {}", op.req->what,
                                             op.req->peer, bad));
        }
        for (const Tensor& t : op.payload)
          if (t.device != device_)
            throw ExecutionError(fmt::format("NCCL send of {}: a tensor is on device {}, not {}",
                                             op.req->what, t.device, device_));
      } else {
        for (const TensorSpec& spec : op.layout) {
          Tensor t;
          t.dtype = spec.dtype;
          t.shape = spec.shape;
          t.nbytes = static_cast<size_t>(num_elements(t.shape)) * dtype_size(t.dtype);
          t.device = device_;
          if (t.nbytes) {
            t.owner = pool_->take(t.nbytes);  // reused across transfers (RecvPool)
            t.data = t.owner.get();
          }
          op.payload.push_back(std::move(t));
        }
      }
    }
    {
      // The communicators stay alive while this group is issued (abort_comms).
      // Non-blocking communicators: ncclGroupEnd returns at once (ncclInProgress
      // while a peer connects), so the lock is never held while waiting for a
      // peer, and abort_comms can always take it; sync() polls outside it.
      std::lock_guard<std::mutex> nccl_lock(nccl_mu_);
      if (aborted_comm_) return;
      nccl_check(api.GroupStart(), "ncclGroupStart");
      for (auto& op : ops) {
        ncclComm_t comm = comms_[static_cast<size_t>(op.channel)];
        for (Tensor& t : op.payload) {
          if (t.nbytes == 0) continue;
          if (op.req->is_send)
            accepted(api.Send(t.data, t.nbytes, ncclUint8, op.req->peer, comm, stream_),
                     "ncclSend");
          else
            accepted(api.Recv(t.data, t.nbytes, ncclUint8, op.req->peer, comm, stream_),
                     "ncclRecv");
        }
      }
      accepted(api.GroupEnd(), "ncclGroupEnd");
    }
    if (!sync()) return;
    for (auto& op : ops) {
      if (op.req->is_send)
        op.req->complete();
      else
        op.req->complete(op.tasks->from_payload(std::move(op.payload)));
    }
  }

  void loop() {
    cudaSetDevice(device_);
    for (;;) {
      std::vector<Op> group;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] {
          if (stop_ || failed_) return true;
          for (auto& op : queue_)
            if (op.flush) return true;
          return false;
        });
        if (stop_ || failed_) return;
        while (!queue_.empty()) {
          Op op = std::move(queue_.front());
          queue_.pop_front();
          if (op.flush) break;
          in_flight_.push_back(op.req);
          group.push_back(std::move(op));
        }
      }
      try {
        if (!group.empty()) run_group(group);
      } catch (const std::exception& e) {
        mark_failed(rank_, fmt::format("NCCL transfer failed: {}", e.what()));
      }
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.clear();
    }
  }

  void watch() {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_ || failed_) return;
      }
      try {
        const std::string v = store_->get("baton/nccl/abort", std::chrono::milliseconds(500));
        const auto bar = v.find('|');
        mark_failed(std::atoi(v.substr(0, bar).c_str()), v.substr(bar + 1));
        return;
      } catch (const std::exception&) {
        // not set yet
      }
    }
  }

  int rank_, world_, device_;
  std::shared_ptr<Store> store_;
  TransportOptions opts_;
  std::vector<ncclComm_t> comms_;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::vector<RequestPtr> in_flight_;
  bool stop_ = false, failed_ = false;
  std::atomic<bool> aborted_comm_{false};  // communicators aborted or destroyed
  std::mutex nccl_mu_;                      // NCCL calls on comms_ vs abort_comms()
  std::shared_ptr<RecvPool> pool_;
  int failed_origin_ = -1;
  std::string failed_reason_;
  int round_ = 0;
  std::thread worker_, watcher_;
};

}  // namespace

bool nccl_available() { return nccl_api().lib != nullptr; }

std::tuple<std::string, int, bool, std::string> nccl_library_info() {
  const NcclApi& a = nccl_api();
  return {a.path, a.version, a.was_mapped, a.lib ? std::string() : a.error};
}

std::unique_ptr<Transport> make_nccl_transport(int rank, int world_size, int device,
                                               std::shared_ptr<Store> store, TransportOptions opts,
                                               int channels) {
  if (!store) throw ConfigError("nccl transport: a rendezvous store is required");
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw ConfigError(
        fmt::format("nccl transport: rank {} is invalid for world size {}", rank, world_size));
  if (channels < 1) throw ConfigError(fmt::format("nccl transport: {} channels", channels));
  return std::make_unique<NcclTransport>(rank, world_size, device, std::move(store), opts,
                                         channels);
}

}  // namespace baton::runtime
