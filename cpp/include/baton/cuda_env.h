// Checks of the CUDA environment a GPU rank program runs in (host side, no CUDA:
// tested on any machine). The CUDA transports (NcclComm, cuda/) call them at
// construction with what the CUDA runtime and the process report, and refuse to
// start, by name, where a check finds a problem.
#pragma once
#include <string>
#include <vector>

namespace baton::runtime::cuda_env {

// The CUDA_DEVICE_MAX_CONNECTIONS value `value` (null: unset). With 1, every
// CUDA stream of the process shares one hardware work queue: the compute
// stream's wait for a receive then blocks the link streams' sends queued behind
// it, and two ranks that each wait before they send deadlock. Empty when the
// value is fine (unset, not a number, or 2 and more); else the sentence that
// refuses it, naming the variable and what to set instead.
std::string max_connections_problem(const char* value);

// The driver's and the runtime's CUDA versions (cudaDriverGetVersion,
// cudaRuntimeGetVersion: 1000*major + 10*minor; driver 0 when no driver is
// installed). CUDA's minor version compatibility lets a runtime of major M run
// on any driver of major M or newer, never on an older major. Empty when they
// fit; else the sentence naming both versions and saying to update the driver.
std::string driver_problem(int driver_version, int runtime_version);
std::string cuda_version_string(int version);  // 13000 -> "13.0"

// Checked again once the process's GPU backend is up (JAX's CUDA plugin maps its
// own libnccl when it starts): `mapped` the libnccl files mapped now
// (nccl_library::mapped("libnccl")), `used` the one Baton loaded. Empty when
// exactly that one is mapped; else the sentence naming every copy.
std::string second_nccl_problem(const std::vector<std::string>& mapped, const std::string& used);

}  // namespace baton::runtime::cuda_env
