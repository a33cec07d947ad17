// The operation group of one baton_comm call, read from XLA's call frame: the
// same for the CPU handlers (ffi_handlers.cc) and the CUDA ones
// (ffi_handlers_cuda.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "baton/comm.h"
#include "xla/ffi/api/ffi.h"

namespace baton::python {

// One baton_comm call's operations, send tensors and received tensors.
struct CommGroup {
  std::vector<runtime::CommOp> ops;
  std::vector<runtime::ConstBytes> sends;
  std::vector<runtime::MutBytes> outs;
};

// Fills the group's `ops` from the kinds/peers/channels/stages attributes (one
// entry per operation; kinds must be CommOpKind values), `sends` from the
// operands after the token and `outs` from the results after the token.
// InvalidArgument for attributes of different lengths or an unknown kind; an
// operand's or result's own decoding error as it is.
inline xla::ffi::Error read_group(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets,
                                  xla::ffi::Span<const int32_t> kinds,
                                  xla::ffi::Span<const int32_t> peers,
                                  xla::ffi::Span<const int32_t> channels,
                                  xla::ffi::Span<const int32_t> stages, CommGroup& group) {
  namespace ffi = xla::ffi;
  namespace rt = baton::runtime;
  auto& [ops, sends, outs] = group;
  if (peers.size() != kinds.size() || channels.size() != kinds.size() ||
      stages.size() != kinds.size())
    return ffi::Error::InvalidArgument("baton_comm: attribute lengths differ");
  ops.resize(kinds.size());
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] < 0 || kinds[i] > 2)
      return ffi::Error::InvalidArgument("baton_comm: unknown operation kind");
    ops[i] = rt::CommOp{static_cast<rt::CommOpKind>(kinds[i]), peers[i], channels[i], stages[i]};
  }
  sends.resize(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    sends[i] = {b->untyped_data(), b->size_bytes()};
  }
  outs.resize(rets.size());
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    outs[i] = {(*b)->untyped_data(), (*b)->size_bytes()};
  }
  return ffi::Error::Success();
}

}  // namespace baton::python
