// NCCL loaded with dlopen (internal to the CUDA sources of baton_runtime).
//
// $BATON_NCCL_LIBRARY, else libnccl.so.2 / libnccl.so from the loader path:
// the JAX CUDA plugin ships its own NCCL and Baton uses that same copy rather
// than linking a second one. Shared by the NCCL transport (nccl.cc) and the
// rank-program context NcclComm (nccl_comm.cc).
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace baton::runtime::nccl_detail {

struct NcclApi {
  void* lib = nullptr;  // null when NCCL could not be loaded (see error)
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRank) CommInitRank = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  std::string error;
};

// Loaded once per process (thread-safe); check `lib` before use.
const NcclApi& nccl_api();

// Throw ExecutionError naming `what` on failure.
void cuda_check(cudaError_t e, const char* what);
void nccl_check(ncclResult_t r, const char* what);

}  // namespace baton::runtime::nccl_detail
