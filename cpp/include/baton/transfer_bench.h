// Transfer benchmark (bench/ffi_transfer.py): round trips between two
// transports of this process, from C++ threads, to compare what a transfer
// costs straight on a transport with what it costs through RankComm (the XLA
// FFI handlers' code, with their copies).
#pragma once
#include <cstddef>
#include <memory>

#include "baton/runtime.h"

namespace baton::runtime {

// `iters` round trips of `nbytes` from `a` to `b` and back, `b` answering
// from its own thread: through a RankComm on each transport (channel 0,
// stage 0) when `through_comm`, otherwise straight on the transports (host
// tensors handed over, no copy). Each wait is bounded by 60 s. Returns
// seconds per round trip. Throws ConfigError when a transport is null.
double pingpong_seconds(const std::shared_ptr<Transport>& a, const std::shared_ptr<Transport>& b,
                        size_t nbytes, int iters, bool through_comm);

}  // namespace baton::runtime
