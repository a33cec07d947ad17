// Checks of the CUDA environment (cuda_env.h): host side, no CUDA.
#include "baton/cuda_env.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cstring>

namespace baton::runtime::cuda_env {

std::string max_connections_problem(const char* value) {
  if (!value || !*value) return "";
  int n = 0;
  const char* end = value + std::strlen(value);
  const auto [ptr, ec] = std::from_chars(value, end, n);
  if (ec != std::errc() || ptr != end || n != 1) return "";
  return "CUDA_DEVICE_MAX_CONNECTIONS=1 is set: every CUDA stream then shares one hardware "
         "queue, so a compute-stream wait for a receive blocks the transfer streams' sends "
         "queued behind it, and two ranks that wait before they send deadlock. Unset it or set "
         "it to 2 or more (CUDA's default is 8) for Baton's GPU transports";
}

std::string cuda_version_string(int version) {
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

std::string driver_problem(int driver_version, int runtime_version) {
  if (driver_version <= 0)
    return fmt::format(
        "no NVIDIA driver is installed (cudaDriverGetVersion reports none); Baton's CUDA runtime "
        "is {} and needs a driver for CUDA {} or newer",
        cuda_version_string(runtime_version), runtime_version / 1000);
  if (driver_version / 1000 >= runtime_version / 1000) return "";
  return fmt::format(
      "the NVIDIA driver is too old: it supports CUDA {}, and Baton's CUDA runtime is {}, which "
      "needs a driver for CUDA {}.x or newer (update the driver, or build Baton against a CUDA "
      "toolkit of major version {})",
      cuda_version_string(driver_version), cuda_version_string(runtime_version),
      runtime_version / 1000, driver_version / 1000);
}

std::string second_nccl_problem(const std::vector<std::string>& mapped, const std::string& used) {
  if (mapped.size() <= 1) return "";
  return fmt::format(
      "{} copies of libnccl are mapped into this process ({}); Baton uses {}. Each copy keeps its "
      "own state, so communicators of one cannot work with the other's: load JAX's GPU backend "
      "(jax.devices()) before Baton's first NCCL context, or point $BATON_NCCL_LIBRARY at the "
      "copy JAX's CUDA plugin loads",
      mapped.size(), fmt::join(mapped, ", "), used.empty() ? "none yet" : used);
}

}  // namespace baton::runtime::cuda_env
