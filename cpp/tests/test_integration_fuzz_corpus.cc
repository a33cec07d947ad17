// Replays the fuzz seed corpus and every input a fuzzer once failed on
// (cpp/fuzz/corpus/<target>/, cpp/fuzz/regressions/<target>/) through the
// fuzz entries (cpp/fuzz/targets.h): bad input must be refused with a
// baton::Error, anything accepted must round-trip. Runs in every C++ build.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../fuzz/targets.h"

namespace {

namespace fs = std::filesystem;

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class FuzzCorpus : public ::testing::TestWithParam<baton::fuzz::Target> {};

TEST_P(FuzzCorpus, ReplaysSeedsAndRegressions) {
  const baton::fuzz::Target t = GetParam();
  const fs::path root(BATON_FUZZ_DIR);
  const auto seeds = files_in(root / "corpus" / std::string(t.name));
  // Every target has a committed seed corpus.
  ASSERT_FALSE(seeds.empty()) << "no seeds in corpus/" << t.name;
  auto all = seeds;
  for (const auto& p : files_in(root / "regressions" / std::string(t.name))) all.push_back(p);
  for (const auto& p : all) {
    SCOPED_TRACE(p.string());
    const std::string bytes = read_all(p);
    t.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
}

std::vector<baton::fuzz::Target> all_targets() {
  size_t n = 0;
  const baton::fuzz::Target* t = baton::fuzz::targets(&n);
  return std::vector<baton::fuzz::Target>(t, t + n);
}

INSTANTIATE_TEST_SUITE_P(Parsers, FuzzCorpus, ::testing::ValuesIn(all_targets()),
                         [](const auto& p) { return std::string(p.param.name); });

}  // namespace
