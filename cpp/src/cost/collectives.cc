// Collective cost formulas (collectives.h).
#include "baton/collectives.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "baton/error.h"

namespace baton {

namespace {

void check(double bytes, int n) {
  if (n < 1) throw ConfigError(fmt::format("collective: ranks must be >= 1 (got {})", n));
  if (!std::isfinite(bytes) || bytes < 0)
    throw ConfigError(fmt::format("collective: bytes must be finite and >= 0 (got {})", bytes));
}

// Collectives run at NCCL's bus bandwidth (nccl-tests busbw), point-to-point
// sends at the link's bandwidth.
double transfer(double bytes, const LinkSpec& link) {
  const double bw = link.collective_bandwidth();
  return bw > 0 ? bytes / bw : 0.0;
}

}  // namespace

const LinkSpec& axis_link(const Hardware& hw, int stride, int size) {
  if (stride < 1 || size < 1)
    throw ConfigError(
        fmt::format("mesh axis: stride and size must be >= 1 (got {} and {})", stride, size));
  return static_cast<int64_t>(stride) * size <= hw.gpus_per_node ? hw.intra : hw.inter;
}

double ring_all_reduce_bytes(double bytes, int n) {
  check(bytes, n);
  return 2.0 * (n - 1) / n * bytes;
}

double ring_gather_bytes(double bytes, int n) {
  check(bytes, n);
  return static_cast<double>(n - 1) / n * bytes;
}

double ring_all_reduce_time(double bytes, int n, const LinkSpec& link) {
  if (n == 1) return check(bytes, n), 0.0;
  return transfer(ring_all_reduce_bytes(bytes, n), link) + 2.0 * (n - 1) * link.latency;
}

double tree_all_reduce_time(double bytes, int n, const LinkSpec& link) {
  check(bytes, n);
  if (n == 1) return 0.0;
  return transfer(2.0 * bytes, link) + 2.0 * std::ceil(std::log2(n)) * link.latency;
}

double all_reduce_time(double bytes, int n, const LinkSpec& link) {
  return std::min(ring_all_reduce_time(bytes, n, link), tree_all_reduce_time(bytes, n, link));
}

double all_gather_time(double bytes, int n, const LinkSpec& link) {
  if (n == 1) return check(bytes, n), 0.0;
  return transfer(ring_gather_bytes(bytes, n), link) + (n - 1) * link.latency;
}

double reduce_scatter_time(double bytes, int n, const LinkSpec& link) {
  return all_gather_time(bytes, n, link);
}

double all_to_all_time(double bytes, int n, const LinkSpec& link) {
  return all_gather_time(bytes, n, link);
}

double overlap_exposed(double comm, double compute, double contention) {
  if (!(comm >= 0) || !(compute >= 0) || !std::isfinite(comm) || !std::isfinite(compute))
    throw ConfigError(fmt::format("overlap: times must be finite and >= 0 (got {} and {})", comm,
                                  compute));
  if (!(contention >= 0 && contention < 1))
    throw ConfigError(fmt::format("overlap: contention must be in [0, 1) (got {})", contention));
  return std::max(0.0, comm - compute) + contention * std::min(comm, compute);
}

double p2p_time(double bytes, const LinkSpec& link) {
  check(bytes, 1);
  return (link.bandwidth > 0 ? bytes / link.bandwidth : 0.0) + link.latency;
}

}  // namespace baton
