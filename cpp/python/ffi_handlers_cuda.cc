// CUDA XLA FFI handlers of a rank program's transfers (baton._core.ffi
// handlers_cuda): the same targets, operands, results and attributes as the
// CPU handlers (ffi_handlers.cc), plus XLA's compute stream, adapted to
// baton::runtime::NcclComm (nccl_comm.h; the `comm` attribute is an id of
// register_nccl_comm). Built only with CUDA and NCCL.
//
// Device slots: every handler binds the calling device's ordinal
// (ffi::Ctx<ffi::DeviceOrdinal>, the CUDA ordinal of the device XLA runs the
// call on) and runs on that slot's context (NcclComm::route: the context the
// program names, or the slot context routed to that device). Under shard_map
// XLA calls the handlers of a rank's devices concurrently; each slot has its
// own streams, staging pool and events, so the calls share no state. The
// handlers are not
// marked command-buffer compatible, so XLA never captures them into a CUDA
// graph (they enqueue NCCL work and record events from the host).
//
// A program whose `comm` id has a host-staged context (find_staged_comm: a
// RankComm staged through pinned host memory, for ranks without NCCL) runs its
// groups through it on the same stream; its marks are not recorded (they
// would be host enqueue times, not stream times).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <memory>
#include <string>
#include <vector>

#include "baton/host_staged.h"
#include "baton/nccl_comm.h"
#include "ffi_group.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace rt = baton::runtime;

namespace {

// The token is a device buffer here: copied on the stream when XLA gave the
// result its own buffer.
ffi::Error pass_token(cudaStream_t stream, const ffi::AnyBuffer& in,
                      ffi::Result<ffi::AnyBuffer>& out) {
  if (in.size_bytes() != out->size_bytes())
    return ffi::Error::InvalidArgument("baton: token size mismatch");
  if (in.untyped_data() != out->untyped_data()) {
    const cudaError_t e = cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess)
      return ffi::Error::Internal(std::string("baton: token copy: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// The context of program context `id` that serves device `ordinal`; keeps the
// lead (which owns the routes) alive in `hold`.
rt::NcclComm& comm_of(int64_t id, int32_t ordinal, std::shared_ptr<rt::NcclComm>& hold) {
  auto c = rt::find_nccl_comm(id);
  if (!c && rt::find_comm(id))
    throw rt::ExecutionError(
        "baton: a program on CUDA names a CPU transfer context (RankComm); a rank on a GPU "
        "needs a runtime.NcclRankComm");
  if (!c)
    throw rt::ExecutionError(
        "baton: the NCCL transfer context of this program is gone (the step that compiled it "
        "was closed)");
  hold = c;
  return c->route(ordinal);
}

ffi::Error CommImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token,
                    ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> token_out,
                    ffi::RemainingRets rets, int64_t comm,
                    ffi::Span<const int32_t> kinds, ffi::Span<const int32_t> peers,
                    ffi::Span<const int32_t> channels, ffi::Span<const int32_t> stages) {
  try {
    baton::python::CommGroup g;
    if (ffi::Error e = baton::python::read_group(args, rets, kinds, peers, channels, stages, g);
        e.failure())
      return e;
    if (auto staged = rt::find_staged_comm(comm)) {
      staged->run_group(g.ops, g.sends, g.outs, stream);
      return pass_token(stream, token, token_out);
    }
    std::shared_ptr<rt::NcclComm> hold;
    comm_of(comm, ordinal, hold).run_group(stream, g.ops, g.sends, g.outs);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return pass_token(stream, token, token_out);
}

ffi::Error DrainImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token,
                     ffi::Result<ffi::AnyBuffer> token_out, int64_t comm) {
  try {
    if (auto staged = rt::find_staged_comm(comm)) {
      staged->comm().drain();  // sends were copied to the host before they were posted
      return pass_token(stream, token, token_out);
    }
    std::shared_ptr<rt::NcclComm> hold;
    comm_of(comm, ordinal, hold).drain(stream);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return pass_token(stream, token, token_out);
}

ffi::Error MarkImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token,
                    ffi::RemainingArgs /*after: ordering only*/,
                    ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, int32_t phase) {
  try {
    if (rt::find_staged_comm(comm)) return pass_token(stream, token, token_out);
    std::shared_ptr<rt::NcclComm> hold;
    rt::NcclComm& c = comm_of(comm, ordinal, hold);
    if (&c == hold.get()) c.mark(stream, phase);  // marks: the lead slot's only
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return pass_token(stream, token, token_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonMarkCuda, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("phase"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonCommCuda, CommImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int32_t>>("kinds")
                                  .Attr<ffi::Span<const int32_t>>("peers")
                                  .Attr<ffi::Span<const int32_t>>("channels")
                                  .Attr<ffi::Span<const int32_t>>("stages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonDrainCuda, DrainImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm"));

void init_ffi_cuda(nb::module_& m) {
  m.def("has_cuda", [] { return true; }, "True: the CUDA handlers (handlers_cuda) were built.");
  m.def(
      "close_all_cuda", [] { return rt::close_all_nccl_comms(); },
      nb::call_guard<nb::gil_scoped_release>(),
      "Closes every NcclRankComm still alive, all at once (registered with atexit by "
      "baton.emit.ffi.register); how many.");
  m.def(
      "handlers_cuda",
      [] {
        nb::dict d;
        d["baton_comm"] = nb::capsule(reinterpret_cast<void*>(&BatonCommCuda));
        d["baton_drain"] = nb::capsule(reinterpret_cast<void*>(&BatonDrainCuda));
        d["baton_mark"] = nb::capsule(reinterpret_cast<void*>(&BatonMarkCuda));
        return d;
      },
      "{target name: PyCapsule of its CUDA XLA FFI handler} (register with "
      "jax.ffi.register_ffi_target(name, capsule, platform='CUDA')); the `comm` attribute is "
      "a runtime.NcclRankComm id.");
}
