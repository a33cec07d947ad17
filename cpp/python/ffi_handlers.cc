// XLA FFI handlers of a rank program's transfers (baton._core.ffi): thin
// adapters from XLA's call frame to baton::runtime::RankComm (comm.h). No
// Python and no GIL on this path: XLA's thread calls the C++ transport.
//
//   baton_comm   token, send tensors...  ->  token, received tensors...
//                attributes: comm (context id), kinds/peers/channels/stages
//                (one entry per operation, see CommOp)
//   baton_drain  token -> token: waits for every posted send (end of a step)
//   baton_mark   token, after... -> token: a task starts (phase 0) or ended
//                (phase 1; `after` are its outputs, so it runs once they exist);
//                recorded only while the context records (a runtime switch:
//                traced and untraced steps run the same executable)
//
// The token (an int32 scalar) orders the calls among themselves and against
// the tasks (see program.py); it is passed through unchanged.
//
// Shards: every handler also reads the calling device's ordinal
// (ffi::Ctx<ffi::DeviceOrdinal>; on CPU the jax device id) and the context maps
// it to a shard (RankComm::set_shards; one shard by default). Under
// jax.shard_map over a rank's devices XLA calls the handlers once per device,
// concurrently; each device's calls use that shard's counters and tags.
// A program that several one-device ranks share (program.py SharedProgram, an
// SPMD program over their devices) is lowered with its first rank's context;
// that context routes each device's calls to its own rank's context
// (RankComm::set_route), which runs the first rank's operations as its own
// (RankComm::set_alias).
//
//   baton_offload  token, slot, xs... -> token: OFFLOAD of one buffer, array j's
//                bytes into host slot slot + j (`slot` an int32 scalar operand:
//                inside a scan it depends on the repetition) of the context's host
//                memory (RankComm::host_slots)
//   baton_fetch  token, slot -> token, xs...: FETCH, those slots' bytes into the
//                arrays (the slots released). Both per shard: each device keeps its
//                own slots.
//
//   baton_device_ordinal  token -> int32 (one element): the calling device's
//                ordinal (a debugging aid: checks what the handlers see)
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "baton/comm.h"
#include "ffi_group.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace rt = baton::runtime;

namespace {

ffi::Error pass_token(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (in.size_bytes() != out->size_bytes())
    return ffi::Error::InvalidArgument("baton: token size mismatch");
  if (in.untyped_data() != out->untyped_data())
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  return ffi::Error::Success();
}

// The context of a call from device `ordinal` to a program lowered with
// context `id`: the member's when the program is shared by several ranks
// (RankComm::route), else that one.
std::shared_ptr<rt::RankComm> comm_of(int64_t id, int32_t ordinal) {
  auto c = rt::find_comm(id);
  if (!c)
    throw rt::ExecutionError(
        "baton: the transfer context of this program is gone (the "
        "step that compiled it was closed)");
  if (auto m = c->route(ordinal)) return m;
  return c;
}

ffi::Error CommImpl(ffi::AnyBuffer token, ffi::RemainingArgs args,
                    ffi::Result<ffi::AnyBuffer> token_out, ffi::RemainingRets rets,
                    int32_t device_ordinal, int64_t comm, ffi::Span<const int32_t> kinds,
                    ffi::Span<const int32_t> peers, ffi::Span<const int32_t> channels,
                    ffi::Span<const int32_t> stages) {
  try {
    baton::python::CommGroup g;
    if (ffi::Error e = baton::python::read_group(args, rets, kinds, peers, channels, stages, g);
        e.failure())
      return e;
    auto c = comm_of(comm, device_ordinal);
    c->run_group(g.ops, g.sends, g.outs, c->shard_of(device_ordinal));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return pass_token(token, token_out);
}

ffi::Error DrainImpl(ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> token_out,
                     int32_t device_ordinal, int64_t comm) {
  try {
    auto c = comm_of(comm, device_ordinal);
    c->drain(c->shard_of(device_ordinal));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return pass_token(token, token_out);
}

ffi::Error MarkImpl(ffi::AnyBuffer token, ffi::RemainingArgs /*after: ordering only*/,
                    ffi::Result<ffi::AnyBuffer> token_out, int32_t device_ordinal, int64_t comm,
                    int32_t phase) {
  try {
    auto c = comm_of(comm, device_ordinal);
    c->mark(phase, c->shard_of(device_ordinal));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  }
  return pass_token(token, token_out);
}

// The host slot an OFFLOAD / FETCH names: its int32 scalar operand.
int32_t slot_of(const ffi::Buffer<ffi::S32>& slot) {
  if (slot.element_count() != 1)
    throw std::runtime_error("the host slot operand must be one int32");
  return slot.typed_data()[0];
}

ffi::Error OffloadImpl(ffi::AnyBuffer token, ffi::Buffer<ffi::S32> slot, ffi::RemainingArgs xs,
                       ffi::Result<ffi::AnyBuffer> token_out, int32_t device_ordinal,
                       int64_t comm) {
  try {
    auto c = comm_of(comm, device_ordinal);
    const int shard = c->shard_of(device_ordinal);
    const int32_t first = slot_of(slot);
    for (size_t j = 0; j < xs.size(); ++j) {
      auto x = xs.get<ffi::AnyBuffer>(j);
      if (x.has_error()) return x.error();
      c->host_slots().put(shard, first + static_cast<int32_t>(j), x->untyped_data(),
                          x->size_bytes());
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("baton_offload: ") + e.what());
  }
  return pass_token(token, token_out);
}

ffi::Error FetchImpl(ffi::AnyBuffer token, ffi::Buffer<ffi::S32> slot,
                     ffi::Result<ffi::AnyBuffer> token_out, ffi::RemainingRets xs,
                     int32_t device_ordinal, int64_t comm) {
  try {
    auto c = comm_of(comm, device_ordinal);
    const int shard = c->shard_of(device_ordinal);
    const int32_t first = slot_of(slot);
    for (size_t j = 0; j < xs.size(); ++j) {
      auto x = xs.get<ffi::AnyBuffer>(j);
      if (x.has_error()) return x.error();
      c->host_slots().take(shard, first + static_cast<int32_t>(j), (*x)->untyped_data(),
                           (*x)->size_bytes());
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("baton_fetch: ") + e.what());
  }
  return pass_token(token, token_out);
}

ffi::Error DeviceOrdinalImpl(ffi::AnyBuffer /*token*/, ffi::Result<ffi::Buffer<ffi::S32>> out,
                             int32_t device_ordinal) {
  if (out->element_count() != 1)
    return ffi::Error::InvalidArgument("baton_device_ordinal: the result must have one element");
  out->typed_data()[0] = device_ordinal;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonMark, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("phase"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonComm, CommImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int32_t>>("kinds")
                                  .Attr<ffi::Span<const int32_t>>("peers")
                                  .Attr<ffi::Span<const int32_t>>("channels")
                                  .Attr<ffi::Span<const int32_t>>("stages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonDrain, DrainImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonOffload, OffloadImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatonFetch, FetchImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    BatonDeviceOrdinal, DeviceOrdinalImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::S32>>().Ctx<ffi::DeviceOrdinal>());

#if BATON_HAVE_NCCL
void init_ffi_cuda(nb::module_& m);  // ffi_handlers_cuda.cc: has_cuda, handlers_cuda
#endif

void init_ffi(nb::module_& root) {
  nb::module_ m = root.def_submodule("ffi", "XLA FFI handlers of rank-program transfers");
  m.def(
      "handlers",
      [] {
        nb::dict d;
        d["baton_comm"] = nb::capsule(reinterpret_cast<void*>(&BatonComm));
        d["baton_drain"] = nb::capsule(reinterpret_cast<void*>(&BatonDrain));
        d["baton_mark"] = nb::capsule(reinterpret_cast<void*>(&BatonMark));
        d["baton_offload"] = nb::capsule(reinterpret_cast<void*>(&BatonOffload));
        d["baton_fetch"] = nb::capsule(reinterpret_cast<void*>(&BatonFetch));
        d["baton_device_ordinal"] = nb::capsule(reinterpret_cast<void*>(&BatonDeviceOrdinal));
        return d;
      },
      "{target name: PyCapsule of its XLA FFI handler} (register with "
      "jax.ffi.register_ffi_target(name, capsule, platform='cpu')).");
  m.def(
      "build_info",
      [] {
        nb::dict d;
        d["jaxlib_version"] = std::string(BATON_JAXLIB_VERSION);
        d["ffi_api_major"] = static_cast<int>(XLA_FFI_API_MAJOR);
        d["ffi_api_minor"] = static_cast<int>(XLA_FFI_API_MINOR);
        return d;
      },
      "{jaxlib_version, ffi_api_major, ffi_api_minor} of the jaxlib FFI headers this module "
      "was built against.");
#if BATON_HAVE_NCCL
  init_ffi_cuda(m);
#else
  m.def(
      "has_cuda", [] { return false; }, "False: built without CUDA/NCCL (no CUDA handlers).");
  m.def(
      "handlers_cuda",
      []() -> nb::dict {
        throw std::runtime_error(
            "baton._core was built without CUDA/nccl.h: no CUDA FFI handlers (rebuild on a "
            "machine with the CUDA toolkit and NCCL headers)");
      },
      "Raises: built without CUDA.");
#endif
}
