// NCCL entry points when Baton is built without CUDA (see cuda/nccl.cc).
#if !defined(BATON_HAVE_NCCL)
#include "baton/nccl_library.h"
#include "baton/runtime.h"

namespace baton::runtime {

bool nccl_available() { return false; }

std::tuple<std::string, int, bool, std::string> nccl_library_info() {
  return {"", 0, false, "Baton was built without CUDA/nccl.h"};
}

std::unique_ptr<Transport> make_nccl_transport(int, int, int, std::shared_ptr<Store>,
                                               TransportOptions, int) {
  throw ConfigError(
      "the NCCL transport is not available: Baton was built without CUDA/nccl.h "
      "(rebuild on a machine with the CUDA toolkit, or use the gloo transport)");
}

}  // namespace baton::runtime
#endif
