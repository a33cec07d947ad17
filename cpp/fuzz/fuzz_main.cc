// libFuzzer entry of one target: BATON_FUZZ_TARGET names it (CMakeLists.txt).
#include <string_view>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const baton::fuzz::Entry entry = [] {
    size_t n = 0;
    const baton::fuzz::Target* all = baton::fuzz::targets(&n);
    for (size_t i = 0; i < n; ++i)
      if (all[i].name == std::string_view(BATON_FUZZ_TARGET)) return all[i].run;
    baton::fuzz::fail(BATON_FUZZ_TARGET, "no such target");
  }();
  entry(data, size);
  return 0;
}
