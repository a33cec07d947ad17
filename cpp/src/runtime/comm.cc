// Transfers of a compiled rank program (see comm.h).
#include "baton/comm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

}  // namespace

const std::vector<size_t>& comm_layout(const CommLayouts& layouts, int rank, int channel,
                                       int stage) {
  auto it = layouts.find({channel, stage});
  if (it == layouts.end())
    throw ExecutionError(fmt::format("rank {}: internal: no layout for the {} buffer of stage {}",
                                     rank, comm_channel_name(channel), stage),
                         rank);
  return it->second;
}

uint64_t comm_tag(uint64_t seq, int channel, int shard) {
  if (channel < 0 || channel >= kCommChannels)
    throw ExecutionError(
        fmt::format("internal: transfer channel {} out of range [0, {})", channel, kCommChannels));
  if (shard < 0 || shard >= kCommShards)
    throw ExecutionError(
        fmt::format("internal: shard {} out of range [0, {})", shard, kCommShards));
  constexpr uint64_t kSeqs = (uint64_t{1} << 42) / (uint64_t{kCommChannels} * kCommShards);
  return kCommTagBase +
         ((seq % kSeqs) * kCommChannels + static_cast<uint64_t>(channel)) * kCommShards +
         static_cast<uint64_t>(shard);
}

RankComm::RankComm(int rank, std::chrono::milliseconds timeout)
    : rank_(rank), timeout_(timeout), host_(std::make_unique<HostOnly>()) {
  reset_shards();
}

void RankComm::reset_shards() {
  shards_.clear();
  const size_t n = static_cast<size_t>(slots_.size());
  for (size_t i = 0; i < n; ++i) shards_.push_back(std::make_unique<Shard>());
}

RankComm::~RankComm() { detach(); }

void RankComm::attach(std::shared_ptr<Transport> transport) {
  if (!transport) throw ConfigError("RankComm::attach: no transport");
  if (transport->rank() != rank_)
    throw ConfigError(fmt::format("RankComm of rank {} attached to the transport of rank {}", rank_,
                                  transport->rank()));
  detach();
  const std::string kind = transport->kind();
  serial_posts_ = kind != "local" && kind != "gloo";  // see comm.h
  transport_ = std::move(transport);
}

void RankComm::detach() {
  if (transport_) transport_->release(host_.get());
  transport_.reset();
  reset_shards();
  sent_ = 0;
  received_ = 0;
  std::lock_guard<std::mutex> lock(mu_);
  failure_.reset();
  events_base_ += events_.size();
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

void RankComm::set_shards(std::vector<int> ordinals) {
  slots_ = DeviceSlots(rank_, std::move(ordinals));
  reset_shards();
}

void RankComm::set_route(int ordinal, std::shared_ptr<RankComm> member) {
  routes_.set(rank_, ordinal, std::move(member));
}

std::shared_ptr<RankComm> RankComm::route(int ordinal) const { return routes_.find(ordinal); }

void RankComm::set_alias(std::vector<std::array<int, 3>> from,
                         std::vector<std::array<int, 3>> to) {
  if (from.size() != to.size())
    throw ConfigError(fmt::format("rank {}: set_alias got {} operations to map and {} targets",
                                  rank_, from.size(), to.size()));
  std::map<std::array<int, 3>, std::array<int, 3>> alias;
  for (size_t i = 0; i < from.size(); ++i) {
    auto [it, fresh] = alias.emplace(from[i], to[i]);
    if (!fresh && it->second != to[i])
      throw ConfigError(fmt::format("rank {}: set_alias maps (peer {}, channel {}, stage {}) "
                                    "twice, differently",
                                    rank_, from[i][0], from[i][1], from[i][2]));
  }
  alias_ = std::move(alias);
}

int RankComm::shard_of(int ordinal) const { return slots_.slot_of(ordinal); }

RankComm::Shard& RankComm::shard_state(int shard) {
  if (shard < 0 || static_cast<size_t>(shard) >= shards_.size())
    throw ExecutionError(
        fmt::format("rank {}: internal: shard {} of {}", rank_, shard, shards_.size()), rank_);
  return *shards_[static_cast<size_t>(shard)];
}

RequestPtr RankComm::t_isend(int peer, uint64_t tag, Value v, const std::string& what, int channel,
                             const Layout& layout) {
  if (!serial_posts_)
    return transport_->isend(peer, tag, std::move(v), what, host_.get(), channel, layout);
  std::lock_guard<std::mutex> lock(post_mu_);
  return transport_->isend(peer, tag, std::move(v), what, host_.get(), channel, layout);
}

RequestPtr RankComm::t_irecv(int peer, uint64_t tag, const std::string& what, int channel,
                             const Layout& layout) {
  if (!serial_posts_) return transport_->irecv(peer, tag, what, host_.get(), channel, layout);
  std::lock_guard<std::mutex> lock(post_mu_);
  return transport_->irecv(peer, tag, what, host_.get(), channel, layout);
}

void RankComm::t_flush() {
  if (!serial_posts_) return transport_->flush();
  std::lock_guard<std::mutex> lock(post_mu_);
  transport_->flush();
}

const std::vector<size_t>& RankComm::layout(int channel, int stage) const {
  return comm_layout(layouts_, rank_, channel, stage);
}

Layout RankComm::layout_of(const std::vector<size_t>& bytes) const {
  Layout out;
  out.reserve(bytes.size());
  for (size_t n : bytes) out.push_back(TensorSpec{DType::U8, {static_cast<int64_t>(n)}});
  return out;
}

std::string RankComm::name(const CommOp& op, uint64_t seq, int shard) const {
  const bool send = op.kind == CommOpKind::Send;
  // "(shard 1)" only when the rank has several: one-device messages stay as they were
  const std::string of = shards_.size() > 1 ? fmt::format(" (shard {})", shard) : std::string();
  auto it = names_.find({op.peer, op.channel, send});
  if (it != names_.end() && !it->second.empty())
    return fmt::format("{} {} rank {}{}", it->second[seq % it->second.size()], send ? "to" : "from",
                       op.peer, of);
  return fmt::format("{}(stage {}) #{} {} rank {}{}", comm_channel_name(op.channel), op.stage, seq,
                     op.kind == CommOpKind::Send ? "to" : "from", op.peer, of);
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
  if (!p.req->wait_until(Clock::now() + timeout_)) {
    const TimeoutBlame b = blame_silence(transport_.get(), r.peer, rank_);
    fail(fmt::format("rank {}: timed out after {:g} s {}{}", rank_, comm_seconds(timeout_), doing,
                     b.note),
         b.origin);
  }
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
    if (p.event >= events_base_ && p.event - events_base_ < events_.size()) {
      CommEvent& e = events_[p.event - events_base_];
      e.started = r.started_at();
      e.completed = r.completed_at();
    }
  }
}

void RankComm::reap(Shard& sh) {
  auto& sends = sh.sends;
  size_t keep = 0;
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sends[i].req->done()) {
      wait_done(sends[i], fmt::format("sending {}", sends[i].req->what));
    } else {
      sends[keep++] = std::move(sends[i]);
    }
  }
  sends.resize(keep);
}

size_t RankComm::note_posted(CommOpKind kind, const CommOp& op, uint64_t seq, int shard,
                             const Request& r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!record_) return SIZE_MAX;
  events_.push_back({kind, op.peer, op.channel, op.stage, seq, r.posted, {}, {}, shard});
  return events_base_ + events_.size() - 1;
}

void RankComm::post_recv(Shard& sh, const CommOp& op, int shard) {
  const auto key = std::make_pair(op.peer, op.channel);
  const uint64_t seq = sh.recv_seq[key];
  const uint64_t tg = comm_tag(seq, op.channel, shard);
  ++sh.recv_seq[key];
  Pending p;
  p.req = t_irecv(op.peer, tg, name(op, seq, shard), op.channel,
                  layout_of(layout(op.channel, op.stage)));
  p.event = note_posted(CommOpKind::Post, op, seq, shard, *p.req);
  ++received_;
  sh.posted[key].push_back(std::move(p));
}

void RankComm::run_group(const std::vector<CommOp>& given, const std::vector<ConstBytes>& sends,
                         const std::vector<MutBytes>& outs, int shard) {
  Shard& sh = shard_state(shard);
  std::vector<CommOp> aliased;  // (set_alias: a shared program's operations as this rank's)
  if (!alias_.empty()) {
    aliased = given;
    for (CommOp& op : aliased) {
      auto it = alias_.find({op.peer, op.channel, op.stage});
      if (it == alias_.end())
        throw ExecutionError(fmt::format("rank {}: internal: the shared program's transfer "
                                         "(peer {}, channel {}, stage {}) has no alias here",
                                         rank_, op.peer, op.channel, op.stage),
                             rank_);
      std::tie(op.peer, op.channel, op.stage) =
          std::make_tuple(it->second[0], it->second[1], it->second[2]);
    }
  }
  const std::vector<CommOp>& ops = alias_.empty() ? given : aliased;
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
    reap(sh);
    for (const CommOp& op : ops) {
      if (op.peer < 0 || op.peer >= transport_->world_size() || op.peer == rank_)
        throw ExecutionError(
            fmt::format("rank {}: internal: transfer peer {} out of range", rank_, op.peer), rank_);
      if (op.channel < 0 || op.channel >= kCommChannels)
        throw ExecutionError(fmt::format("rank {}: internal: transfer channel {} out of range "
                                         "[0, {})",
                                         rank_, op.channel, kCommChannels),
                             rank_);
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
                              rank_, comm_channel_name(op.channel), op.stage, op.peer, i, b.size,
                              sizes[i]),
                  rank_);
            // XLA may reuse its buffer once this call returns: the transport gets a copy.
            Tensor t = alloc_host_tensor(DType::U8, {static_cast<int64_t>(b.size)});
            if (b.size) std::memcpy(t.data, b.data, b.size);
            payload.push_back(std::move(t));
          }
          const auto key = std::make_pair(op.peer, op.channel);
          const uint64_t seq = sh.send_seq[key];
          const uint64_t tg = comm_tag(seq, op.channel, shard);
          ++sh.send_seq[key];
          Pending p;
          p.req = t_isend(op.peer, tg, std::make_shared<HostValue>(std::move(payload)),
                          name(op, seq, shard), op.channel, layout_of(sizes));
          p.event = note_posted(CommOpKind::Send, op, seq, shard, *p.req);
          ++sent_;
          sh.sends.push_back(std::move(p));
          unflushed = true;
          break;
        }
        case CommOpKind::Post:
          post_recv(sh, op, shard);
          unflushed = true;
          break;
        case CommOpKind::Wait: {
          if (unflushed) {
            t_flush();
            unflushed = false;
          }
          const auto key = std::make_pair(op.peer, op.channel);
          auto& q = sh.posted[key];
          if (q.empty()) {  // not posted ahead: post it now
            post_recv(sh, op, shard);
            t_flush();
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
    if (unflushed) t_flush();
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

void RankComm::drain(int shard) {
  Shard& sh = shard_state(shard);
  if (!transport_) return;
  for (const Pending& p : sh.sends) wait_done(p, fmt::format("sending {}", p.req->what));
  sh.sends.clear();
}

std::optional<std::pair<int, std::string>> RankComm::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void RankComm::mark(int phase, int shard) {
  if (shard != 0) return;  // every shard has the same task boundaries
  std::lock_guard<std::mutex> lock(mu_);
  if (record_) marks_.emplace_back(phase, Clock::now());
}

std::vector<std::pair<int, Clock::time_point>> RankComm::take_marks() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int, Clock::time_point>> out = std::move(marks_);
  marks_.clear();
  return out;
}

std::vector<CommEvent> RankComm::take_events() {
  std::lock_guard<std::mutex> lock(mu_);
  events_base_ += events_.size();
  std::vector<CommEvent> out = std::move(events_);
  events_.clear();
  return out;
}

std::pair<uint64_t, uint64_t> RankComm::counts() const { return {sent_, received_}; }

// ---------------------------------------------------------------- registry

namespace {
CommRegistry<RankComm>& registry() {
  static auto* r = new CommRegistry<RankComm>(1);  // never destroyed
  return *r;
}
}  // namespace

int64_t register_comm(std::shared_ptr<RankComm> comm) { return registry().add(std::move(comm)); }

void unregister_comm(int64_t id) { registry().remove(id); }

std::shared_ptr<RankComm> find_comm(int64_t id) { return registry().find(id); }

}  // namespace baton::runtime
