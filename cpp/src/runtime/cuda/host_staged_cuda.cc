// The CUDA StagingDevice of host-staged transfers (host_staged.h): pinned host
// buffers, one non-blocking copy stream and events on device `ordinal`.
#include <cuda_runtime_api.h>

#include <memory>

#include "baton/host_staged.h"
#include "nccl_api.h"

namespace baton::runtime {
namespace {

using nccl_detail::cuda_check;

class CudaStagingDevice : public StagingDevice {
 public:
  explicit CudaStagingDevice(int ordinal) : ordinal_(ordinal) {
    on();
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags (host staging)");
  }
  ~CudaStagingDevice() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaStreamDestroy(stream_);
  }
  Stream copy_stream() override { return stream_; }
  void* alloc_pinned(size_t bytes) override {
    on();
    void* p = nullptr;
    cuda_check(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc (host staging)");
    return p;
  }
  void free_pinned(void* p) override { cudaFreeHost(p); }
  Event create_event() override {
    on();
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
               "cudaEventCreate (host staging)");
    return e;
  }
  void destroy_event(Event e) override { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }
  void copy_d2h(void* host, const void* device, size_t bytes, Stream s) override {
    on();
    cuda_check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, as_stream(s)),
               "cudaMemcpyAsync D2H (host staging)");
  }
  void copy_h2d(void* device, const void* host, size_t bytes, Stream s) override {
    on();
    cuda_check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, as_stream(s)),
               "cudaMemcpyAsync H2D (host staging)");
  }
  void record(Event e, Stream s) override {
    cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(e), as_stream(s)),
               "cudaEventRecord (host staging)");
  }
  void wait(Stream s, Event e) override {
    cuda_check(cudaStreamWaitEvent(as_stream(s), static_cast<cudaEvent_t>(e), 0),
               "cudaStreamWaitEvent (host staging)");
  }
  void sync(Event e) override {
    cuda_check(cudaEventSynchronize(static_cast<cudaEvent_t>(e)),
               "cudaEventSynchronize (host staging)");
  }

 private:
  static cudaStream_t as_stream(Stream s) { return static_cast<cudaStream_t>(s); }
  void on() const { cuda_check(cudaSetDevice(ordinal_), "cudaSetDevice (host staging)"); }
  int ordinal_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<StagingDevice> make_cuda_staging_device(int ordinal) {
  return std::make_unique<CudaStagingDevice>(ordinal);
}

}  // namespace baton::runtime
