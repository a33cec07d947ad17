// Golden-file comparison shared by the C++ tests of text forms.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace baton::testing {

// Compares `text` with the golden file `name` (BATON_GOLDEN_DIR);
// BATON_UPDATE_GOLDEN=1 rewrites it. `what` names the text in a failure.
inline void expect_golden(const std::string& name, const std::string& text,
                          const std::string& what) {
  const std::string path = std::string(BATON_GOLDEN_DIR) + "/" + name;
  if (std::getenv("BATON_UPDATE_GOLDEN")) {
    std::ofstream(path) << text;
    return;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path << " is missing (run with BATON_UPDATE_GOLDEN=1 to write it)";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), text) << what << " differs from " << path;
}

}  // namespace baton::testing
