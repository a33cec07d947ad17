// Host-staged transfers for CUDA rank programs whose ranks cannot use NCCL
// (two ranks on one GPU, or no NCCL): device -> pinned host -> the rank's
// RankComm (Gloo) -> pinned host -> device, ordered with events against XLA's
// stream. Every CUDA call goes through StagingDevice, so the ordering is
// testable on CPU with a device that logs its calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "baton/comm.h"

namespace baton::runtime {

class HostStagedComm;

// The CUDA calls of host staging. Streams and events are opaque handles.
class StagingDevice {
 public:
  using Stream = void*;
  using Event = void*;
  virtual ~StagingDevice() = default;
  // The stream staging copies run on (owned by the device).
  virtual Stream copy_stream() = 0;
  virtual void* alloc_pinned(size_t bytes) = 0;
  virtual void free_pinned(void* p) = 0;
  virtual Event create_event() = 0;
  virtual void destroy_event(Event e) = 0;
  // Enqueued on `s`, in stream order.
  virtual void copy_d2h(void* host, const void* device, size_t bytes, Stream s) = 0;
  virtual void copy_h2d(void* device, const void* host, size_t bytes, Stream s) = 0;
  virtual void record(Event e, Stream s) = 0;
  // `s` waits (on the device) for `e`.
  virtual void wait(Stream s, Event e) = 0;
  // The host waits for `e`.
  virtual void sync(Event e) = 0;
};

// Host-staged contexts by the id of the RankComm they stage (the `comm`
// attribute of the program's FFI calls): the CUDA handlers run a program
// whose id has one here through it. Thread-safe; registering an id again
// replaces its entry.
void register_staged_comm(int64_t id, std::shared_ptr<HostStagedComm> comm);
void unregister_staged_comm(int64_t id);
std::shared_ptr<HostStagedComm> find_staged_comm(int64_t id);  // null when unknown

// The CUDA device of host staging on device `ordinal` (a non-blocking copy
// stream, pinned buffers, events without timing). Defined only in builds with
// the CUDA transport (BATON_HAVE_NCCL).
std::unique_ptr<StagingDevice> make_cuda_staging_device(int ordinal);

// The transport selected for a CUDA rank: NCCL, or host staging and why.
enum class CudaTransport { Nccl, HostStaged };
struct CudaTransportChoice {
  CudaTransport transport = CudaTransport::Nccl;
  std::string reason;  // empty for NCCL; else the one log line saying why staging is used
};
// `ordinals[r]`: the GPU (device ordinal, on `hosts[r]`) of rank r (equal
// lengths). Host staging when two ranks on one host share a GPU, or when NCCL
// is not available (`nccl_error` says why); else NCCL. Throws std::invalid_argument
// on mismatched lengths or a negative ordinal.
CudaTransportChoice choose_cuda_transport(const std::vector<std::string>& hosts,
                                          const std::vector<int>& ordinals, bool nccl_available,
                                          const std::string& nccl_error);

// One rank's host-staged transfers on one device: runs a group of RankComm
// operations whose send tensors and results live in device memory.
class HostStagedComm {
 public:
  HostStagedComm(std::shared_ptr<RankComm> comm, std::unique_ptr<StagingDevice> device);
  ~HostStagedComm();
  HostStagedComm(const HostStagedComm&) = delete;
  HostStagedComm& operator=(const HostStagedComm&) = delete;

  // Runs `ops` like RankComm::run_group with device `sends` and `outs`,
  // ordered against `xla_stream`: the sends' D2H copies wait for the work XLA
  // enqueued before this call, and the host waits for them before the RankComm
  // sends; every receive completes (RankComm WAIT) before its H2D copy is
  // enqueued, and `xla_stream` waits for those copies. Throws ExecutionError.
  void run_group(const std::vector<CommOp>& ops, const std::vector<ConstBytes>& sends,
                 const std::vector<MutBytes>& outs, StagingDevice::Stream xla_stream,
                 int shard = 0);
  // Pinned bytes held (the largest group's sends + results so far).
  size_t staging_bytes() const { return capacity_; }
  RankComm& comm() { return *comm_; }

 private:
  void ensure(size_t bytes);

  std::shared_ptr<RankComm> comm_;
  std::unique_ptr<StagingDevice> dev_;
  StagingDevice::Event produced_ = nullptr, copied_ = nullptr;
  void* pinned_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace baton::runtime
