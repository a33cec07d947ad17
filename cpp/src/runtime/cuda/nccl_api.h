// NCCL loaded with dlopen (internal to the CUDA sources of baton_runtime).
//
// The copy of NCCL already mapped into the process (JAX's CUDA plugin maps its
// own when its GPU backend starts) is used when there is one, opened with
// RTLD_NOLOAD; else $BATON_NCCL_LIBRARY, then libnccl.so.2 / libnccl.so from the
// loader path (nccl_library.h: the order and the version rule). The library's
// ncclGetVersion must have the major version of the nccl.h Baton was compiled
// against. Shared by the NCCL transport (nccl.cc) and the rank-program context
// NcclComm (nccl_comm*.cc).
//
// Communicators are made non-blocking (ncclConfig_t.blocking = 0): no NCCL call
// blocks the host waiting for a peer; a call may return ncclInProgress, and
// the communicator is then polled (ncclCommGetAsyncError, wait_ready) under a
// deadline, so a peer that never comes is an error naming it, not a hang, and
// ncclCommAbort can always run (no lock is held across a wait).
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace baton::runtime::nccl_detail {

struct NcclApi {
  void* lib = nullptr;  // null when NCCL could not be loaded (see error)
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommFinalize) CommFinalize = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  std::string error;
  std::string path;     // the file loaded
  int version = 0;      // ncclGetVersion
  bool was_mapped = false;  // already mapped by the process (JAX's copy)
};

// Loaded once per process (thread-safe); check `lib` before use. Logs one line
// (version, path, whether it was JAX's mapped copy) to stderr when loaded,
// unless $BATON_QUIET is set.
const NcclApi& nccl_api();

// Throw ExecutionError naming `what` on failure (ncclInProgress is a failure
// here: use accepted() where a non-blocking call may return it).
void cuda_check(cudaError_t e, const char* what);
void nccl_check(ncclResult_t r, const char* what);
// True for ncclSuccess and ncclInProgress; throws like nccl_check otherwise.
bool accepted(ncclResult_t r, const char* what);

// A config for a non-blocking communicator.
ncclConfig_t nonblocking_config();

// Polls every communicator's ncclCommGetAsyncError until none is in progress.
// `mu` (may be null) is taken around each poll only, and `gone` (may be empty)
// returning true means the communicators were aborted meanwhile (then
// ExecutionError).
// An error of communicator i, or communicator i still in progress at
// `deadline`, throws ExecutionError "<doing>: <describe(i)> ...". The caller
// aborts the communicators after a throw.
void wait_ready(const std::vector<ncclComm_t>& comms,
                std::chrono::steady_clock::time_point deadline,
                const std::function<std::string(size_t)>& describe, const std::string& doing,
                std::mutex* mu = nullptr, const std::function<bool()>& gone = {});

}  // namespace baton::runtime::nccl_detail
