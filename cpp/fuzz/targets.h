// The fuzzed parsers of outside input (one entry per libFuzzer target, see
// CMakeLists.txt here). Each entry feeds `data` to one parser and checks what
// every caller relies on: bad input is refused with a baton::Error (any other
// exception escapes and is a finding), nothing crashes or reads out of bounds
// (the sanitizers), and what is accepted survives a round trip through its
// writer. The same entries replay the committed corpus and every input that
// once failed in the C++ tests (test_integration_fuzz_corpus.cc), so a
// regression shows without clang or libFuzzer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace baton::fuzz {

using Entry = void (*)(const uint8_t* data, size_t size);

struct Target {
  std::string_view name;  // fuzz_<name>, corpus/<name>/, regressions/<name>/
  Entry run;
};

// Every target, in the order scripts/fuzz.sh runs them.
const Target* targets(size_t* count);
// Aborts with `what` on stderr: a broken invariant (libFuzzer reports it as a crash).
[[noreturn]] void fail(std::string_view target, std::string_view what);

}  // namespace baton::fuzz
