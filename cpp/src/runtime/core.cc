// Runtime basics: dtypes, aligned host tensors, requests, Tasks defaults.
#include <fmt/format.h>
#include <fmt/ranges.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <new>

#include "baton/runtime.h"

namespace baton::runtime {

namespace {
struct DTypeInfo {
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {"float32", 4}, {"float64", 8}, {"float16", 2}, {"bfloat16", 2}, {"int8", 1},
    {"int16", 2},   {"int32", 4},   {"int64", 8},   {"uint8", 1},    {"uint16", 2},
    {"uint32", 4},  {"uint64", 8},  {"bool", 1},
};
constexpr int kNumDTypes = static_cast<int>(sizeof(kDTypes) / sizeof(kDTypes[0]));
}  // namespace

const char* dtype_name(DType d) {
  const int i = static_cast<int>(d);
  return i < kNumDTypes ? kDTypes[i].name : "?";
}

size_t dtype_size(DType d) {
  const int i = static_cast<int>(d);
  if (i >= kNumDTypes) throw ConfigError(fmt::format("unknown dtype code {}", i));
  return kDTypes[i].size;
}

DType dtype_from_name(const std::string& name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (name == kDTypes[i].name) return static_cast<DType>(i);
  std::string known;
  for (int i = 0; i < kNumDTypes; ++i) known += fmt::format("{}{}", i ? ", " : "", kDTypes[i].name);
  throw ConfigError(fmt::format("unsupported dtype '{}' (supported: {})", name, known));
}

int64_t num_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw ConfigError(fmt::format("negative dimension {} in a tensor shape", d));
    n *= d;
  }
  return n;
}

Tensor alloc_host_tensor(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.nbytes = static_cast<size_t>(num_elements(shape)) * dtype_size(dtype);
  t.shape = std::move(shape);
  constexpr size_t kAlign = 64;
  const size_t alloc = ((t.nbytes + kAlign - 1) / kAlign) * kAlign + kAlign;  // never 0
  void* p = std::aligned_alloc(kAlign, alloc);
  if (p == nullptr) throw std::bad_alloc();
  t.owner = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.data = p;
  return t;
}

std::string describe_layout(const Layout& layout) {
  std::string out = "[";
  for (size_t i = 0; i < layout.size(); ++i)
    out += fmt::format("{}{}[{}]", i ? ", " : "", dtype_name(layout[i].dtype),
                       fmt::join(layout[i].shape, ","));
  return out + "]";
}

std::string layout_mismatch(const Payload& p, const Layout& layout) {
  Layout got;
  got.reserve(p.size());
  for (const Tensor& t : p) got.push_back({t.dtype, t.shape});
  if (got == layout) return "";
  return fmt::format("the value is {} but the receiver expects {}", describe_layout(got),
                     describe_layout(layout));
}

bool retain_host_memory() {
#ifdef __GLIBC__
  // Fixed thresholds replace glibc's dynamic mmap threshold: blocks up to
  // 1 GiB (32 MiB where glibc caps the threshold) come from the heap, freed
  // memory stays there (no trim), and the heap grows in 256 MiB steps.
  const bool mmap_ok =
      mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 || mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  return mmap_ok && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1 && mallopt(M_TOP_PAD, 256 << 20) == 1;
#else
  return false;
#endif
}

size_t HostValue::nbytes() const {
  size_t n = 0;
  for (const Tensor& t : tensors) n += t.nbytes;
  return n;
}

// ---------------------------------------------------------------- Request

void Request::mark_started() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_ == Clock::time_point{}) started_ = Clock::now();
}

void Request::complete(Value v) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    const auto now = Clock::now();
    if (started_ == Clock::time_point{}) started_ = now;
    completed_ = now;
    value_ = std::move(v);
    done_ = true;
  }
  cv_.notify_all();
}

void Request::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    completed_ = Clock::now();
    error_ = std::move(e);
    done_ = true;
  }
  cv_.notify_all();
}

bool Request::wait_until(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline, [&] { return done_; });
}

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Request::check() const {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e = error_;
  }
  if (e) std::rethrow_exception(e);
}

Value Request::take_value() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(value_);
}

Clock::time_point Request::started_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_;
}

Clock::time_point Request::completed_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

// ---------------------------------------------------------------- Tasks

Value Tasks::received(int, int32_t, Value v) { return v; }

Payload Tasks::to_payload(const Value& v) {
  if (auto* h = dynamic_cast<HostValue*>(v.get())) return h->tensors;
  throw ExecutionError(
      "this value cannot cross a byte transport: the Tasks give no to_payload conversion");
}

Value Tasks::from_payload(Payload p) { return std::make_shared<HostValue>(std::move(p)); }

Layout Tasks::recv_layout(int, int32_t) { return {}; }

const char* runtime_version() { return "baton-runtime 0.1.0"; }

std::string handshake_blob(const Plan& plan, int world_size) {
  const Schedule& s = plan.schedule;
  return fmt::format("version={}|plan={}|schedule={} ranks={} stages={} microbatches={}|world={}",
                     runtime_version(), plan.fingerprint(), s.name, s.num_ranks, s.num_stages,
                     s.num_microbatches, world_size);
}

TimeoutBlame blame_silence(const Transport* transport, int waited, int fallback) {
  TimeoutBlame out{fallback, {}};
  if (transport == nullptr) return out;
  const std::vector<Transport::Silence> silent = transport->silent_peers();
  if (silent.empty()) return out;
  out.origin = silent.front().rank;
  std::vector<std::string> parts;
  for (const auto& s : silent) parts.push_back(fmt::format("rank {} for {:.1f} s", s.rank, s.seconds));
  const bool waited_silent =
      std::any_of(silent.begin(), silent.end(), [&](const auto& s) { return s.rank == waited; });
  out.note = fmt::format(
      "; silent (no heartbeat): {}: a stopped, hung or cut-off process{}", fmt::join(parts, ", "),
      waited_silent || waited < 0
          ? std::string()
          : fmt::format(" that rank {} may be waiting for", waited));
  return out;
}

}  // namespace baton::runtime
