// Transfers of a compiled rank program (see comm.h).
#include "baton/comm.h"

#include <fmt/format.h>

#include <cstring>

namespace baton::runtime {

namespace {

// Byte transports convert HostValues with the Tasks defaults; nothing runs tasks here.
class HostOnly : public Tasks {
 public:
  std::vector<Value> run(const TaskCall&) override {
    throw ExecutionError("internal: a rank program's transport ran a task");
  }
  void accumulate(int, int32_t, const Value&) override {
    throw ExecutionError("internal: a rank program's transport accumulated");
  }
};

const char* channel_name(int c) {
  switch (c) {
    case 0:
      return "act";
    case 1:
      return "grad";
    default:
      return "buffer";
  }
}

double seconds(std::chrono::milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }

}  // namespace

RankComm::RankComm(int rank, std::chrono::milliseconds timeout)
    : rank_(rank), timeout_(timeout), host_(std::make_unique<HostOnly>()) {}

RankComm::~RankComm() { detach(); }

void RankComm::attach(std::shared_ptr<Transport> transport) {
  if (!transport) throw ConfigError("RankComm::attach: no transport");
  if (transport->rank() != rank_)
    throw ConfigError(fmt::format("RankComm of rank {} attached to the transport of rank {}", rank_,
                                  transport->rank()));
  detach();
  transport_ = std::move(transport);
}

void RankComm::detach() {
  if (transport_) transport_->release(host_.get());
  transport_.reset();
  send_seq_.clear();
  recv_seq_.clear();
  posted_.clear();
  sends_.clear();
  sent_ = received_ = 0;
  std::lock_guard<std::mutex> lock(mu_);
  failure_.reset();
  events_.clear();
  marks_.clear();
}

bool RankComm::attached() const { return static_cast<bool>(transport_); }

void RankComm::set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

void RankComm::set_layout(int channel, int stage, std::vector<size_t> bytes) {
  layouts_[{channel, stage}] = std::move(bytes);
}

void RankComm::set_names(int peer, int channel, bool send, std::vector<std::string> names) {
  names_[{peer, channel, send}] = std::move(names);
}

void RankComm::record(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  record_ = on;
}

uint64_t RankComm::tag(uint64_t seq, int channel) const {
  constexpr uint64_t kSpan = uint64_t{1} << 42;
  constexpr uint64_t kChannels = 8;
  return kCommTagBase + (seq * kChannels + static_cast<uint64_t>(channel)) % kSpan;
}

const std::vector<size_t>& RankComm::layout(int channel, int stage) const {
  auto it = layouts_.find({channel, stage});
  if (it == layouts_.end())
    throw ExecutionError(fmt::format("rank {}: internal: no layout for the {} buffer of stage {}",
                                     rank_, channel_name(channel), stage),
                         rank_);
  return it->second;
}

Layout RankComm::layout_of(const std::vector<size_t>& bytes) const {
  Layout out;
  out.reserve(bytes.size());
  for (size_t n : bytes) out.push_back(TensorSpec{DType::U8, {static_cast<int64_t>(n)}});
  return out;
}

std::string RankComm::name(const CommOp& op, uint64_t seq) const {
  const bool send = op.kind == CommOpKind::Send;
  auto it = names_.find({op.peer, op.channel, send});
  if (it != names_.end() && !it->second.empty())
    return fmt::format("{} {} rank {}", it->second[seq % it->second.size()], send ? "to" : "from",
                       op.peer);
  return fmt::format("{}(stage {}) #{} {} rank {}", channel_name(op.channel), op.stage, seq,
                     op.kind == CommOpKind::Send ? "to" : "from", op.peer);
}

void RankComm::abort(const std::string& msg, int origin) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = std::make_pair(origin, msg);
  }
  if (transport_) transport_->abort(msg, origin);
}

void RankComm::fail(const std::string& msg, int origin) {
  abort(msg, origin);
  throw ExecutionError(msg, origin);
}

void RankComm::wait_done(const Pending& p, const std::string& doing) {
  const Request& r = *p.req;
  if (!p.req->wait_until(Clock::now() + timeout_))
    fail(fmt::format("rank {}: timed out after {:g} s {}", rank_, seconds(timeout_), doing), rank_);
  try {
    r.check();
  } catch (const ExecutionError& e) {
    fail(fmt::format("rank {}: {}: {}", rank_, doing, e.what()),
         e.failed_rank >= 0 ? e.failed_rank : rank_);
  } catch (const std::exception& e) {
    fail(fmt::format("rank {}: {}: {}", rank_, doing, e.what()), rank_);
  }
  if (p.event != SIZE_MAX) {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.event < events_.size()) {
      events_[p.event].started = r.started_at();
      events_[p.event].completed = r.completed_at();
    }
  }
}

void RankComm::reap() {
  size_t keep = 0;
  for (size_t i = 0; i < sends_.size(); ++i) {
    if (sends_[i].req->done()) {
      wait_done(sends_[i], fmt::format("sending {}", sends_[i].req->what));
    } else {
      sends_[keep++] = std::move(sends_[i]);
    }
  }
  sends_.resize(keep);
}

size_t RankComm::note_posted(CommOpKind kind, const CommOp& op, uint64_t seq, const Request& r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!record_) return SIZE_MAX;
  events_.push_back({kind, op.peer, op.channel, op.stage, seq, r.posted, {}, {}});
  return events_.size() - 1;
}

void RankComm::post_recv(const CommOp& op) {
  const auto key = std::make_pair(op.peer, op.channel);
  const uint64_t seq = recv_seq_[key]++;
  Pending p;
  p.req = transport_->irecv(op.peer, tag(seq, op.channel), name(op, seq), host_.get(), op.channel,
                            layout_of(layout(op.channel, op.stage)));
  p.event = note_posted(CommOpKind::Post, op, seq, *p.req);
  ++received_;
  posted_[key].push_back(std::move(p));
}

void RankComm::run_group(const std::vector<CommOp>& ops, const std::vector<ConstBytes>& sends,
                         const std::vector<MutBytes>& outs) {
  if (!transport_)
    throw ExecutionError(
        fmt::format("rank {}: internal: a rank program ran with no transport attached", rank_),
        rank_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) throw ExecutionError(failure_->second, failure_->first);
  }
  size_t in = 0, out = 0;
  bool unflushed = false;
  try {
    reap();
    for (const CommOp& op : ops) {
      if (op.peer < 0 || op.peer >= transport_->world_size() || op.peer == rank_)
        throw ExecutionError(
            fmt::format("rank {}: internal: transfer peer {} out of range", rank_, op.peer), rank_);
      switch (op.kind) {
        case CommOpKind::Send: {
          const auto& sizes = layout(op.channel, op.stage);
          if (in + sizes.size() > sends.size())
            throw ExecutionError(
                fmt::format("rank {}: internal: a send group has too few inputs", rank_), rank_);
          Payload payload;
          payload.reserve(sizes.size());
          for (size_t i = 0; i < sizes.size(); ++i, ++in) {
            const ConstBytes& b = sends[in];
            if (b.size != sizes[i])
              throw ExecutionError(
                  fmt::format("rank {}: sending the {} buffer of stage {} to rank {}: tensor {} "
                              "has {} bytes, the receiver expects {}",
                              rank_, channel_name(op.channel), op.stage, op.peer, i, b.size,
                              sizes[i]),
                  rank_);
            // XLA may reuse its buffer once this call returns: the transport gets a copy.
            Tensor t = alloc_host_tensor(DType::U8, {static_cast<int64_t>(b.size)});
            if (b.size) std::memcpy(t.data, b.data, b.size);
            payload.push_back(std::move(t));
          }
          const auto key = std::make_pair(op.peer, op.channel);
          const uint64_t seq = send_seq_[key]++;
          Pending p;
          p.req = transport_->isend(op.peer, tag(seq, op.channel),
                                    std::make_shared<HostValue>(std::move(payload)), name(op, seq),
                                    host_.get(), op.channel, layout_of(sizes));
          p.event = note_posted(CommOpKind::Send, op, seq, *p.req);
          ++sent_;
          sends_.push_back(std::move(p));
          unflushed = true;
          break;
        }
        case CommOpKind::Post:
          post_recv(op);
          unflushed = true;
          break;
        case CommOpKind::Wait: {
          if (unflushed) {
            transport_->flush();
            unflushed = false;
          }
          const auto key = std::make_pair(op.peer, op.channel);
          auto& q = posted_[key];
          if (q.empty()) {  // not posted ahead: post it now
            post_recv(op);
            transport_->flush();
          }
          Pending p = std::move(q.front());
          q.pop_front();
          const std::string doing = fmt::format("receiving {}", p.req->what);
          wait_done(p, doing);
          Value v = p.req->take_value();
          auto* hv = dynamic_cast<HostValue*>(v.get());
          const auto& sizes = layout(op.channel, op.stage);
          if (hv == nullptr || hv->tensors.size() != sizes.size())
            throw ExecutionError(fmt::format("rank {}: {}: got {} tensors, expected {}", rank_,
                                             doing, hv ? hv->tensors.size() : 0, sizes.size()),
                                 rank_);
          for (size_t i = 0; i < sizes.size(); ++i, ++out) {
            if (out >= outs.size())
              throw ExecutionError(
                  fmt::format("rank {}: internal: a receive group has too few results", rank_),
                  rank_);
            const Tensor& t = hv->tensors[i];
            if (t.nbytes != outs[out].size)
              throw ExecutionError(fmt::format("rank {}: {}: tensor {} has {} bytes, expected {}",
                                               rank_, doing, i, t.nbytes, outs[out].size),
                                   rank_);
            if (t.nbytes) std::memcpy(outs[out].data, t.data, t.nbytes);
          }
          break;
        }
      }
    }
    if (unflushed) transport_->flush();
  } catch (const ExecutionError& e) {
    bool known = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      known = failure_.has_value();
    }
    if (known) throw;
    fail(e.what(), e.failed_rank >= 0 ? e.failed_rank : rank_);
  } catch (const std::exception& e) {
    fail(fmt::format("rank {}: {}", rank_, e.what()), rank_);
  }
  if (in != sends.size() || out != outs.size())
    fail(fmt::format("rank {}: internal: a transfer group used {} of {} inputs and {} of {} "
                     "results",
                     rank_, in, sends.size(), out, outs.size()),
         rank_);
}

void RankComm::drain() {
  if (!transport_) return;
  for (const Pending& p : sends_) wait_done(p, fmt::format("sending {}", p.req->what));
  sends_.clear();
}

std::optional<std::pair<int, std::string>> RankComm::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void RankComm::mark(int phase) {
  std::lock_guard<std::mutex> lock(mu_);
  if (record_) marks_.emplace_back(phase, Clock::now());
}

std::vector<std::pair<int, Clock::time_point>> RankComm::take_marks() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(marks_);
}

std::vector<CommEvent> RankComm::take_events() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(events_);
}

std::pair<uint64_t, uint64_t> RankComm::counts() const { return {sent_, received_}; }

// ---------------------------------------------------------------- registry

namespace {
std::mutex g_mu;
std::map<int64_t, std::shared_ptr<RankComm>>& registry() {
  static auto* r = new std::map<int64_t, std::shared_ptr<RankComm>>();  // never destroyed
  return *r;
}
int64_t g_next = 1;
}  // namespace

int64_t register_comm(std::shared_ptr<RankComm> comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t id = g_next++;
  registry()[id] = std::move(comm);
  return id;
}

void unregister_comm(int64_t id) {
  std::shared_ptr<RankComm> gone;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = registry().find(id);
    if (it == registry().end()) return;
    gone = std::move(it->second);
    registry().erase(it);
  }
}

std::shared_ptr<RankComm> find_comm(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

}  // namespace baton::runtime
