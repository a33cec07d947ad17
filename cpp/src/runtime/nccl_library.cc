// Finding and checking the NCCL library (nccl_library.h).
#include "baton/nccl_library.h"

#include <fmt/format.h>
#include <link.h>

#include <algorithm>

namespace baton::runtime::nccl_library {

namespace {

struct Search {
  const std::string* prefix;
  std::vector<std::string>* out;
};

int visit(struct dl_phdr_info* info, size_t /*size*/, void* data) {
  auto* s = static_cast<Search*>(data);
  if (info->dlpi_name == nullptr || *info->dlpi_name == '\0') return 0;
  const std::string path(info->dlpi_name);
  const size_t slash = path.rfind('/');
  const std::string file = slash == std::string::npos ? path : path.substr(slash + 1);
  if (file.rfind(*s->prefix, 0) == 0 &&
      std::find(s->out->begin(), s->out->end(), path) == s->out->end())
    s->out->push_back(path);
  return 0;
}

}  // namespace

std::vector<std::string> mapped(const std::string& prefix) {
  std::vector<std::string> out;
  Search s{&prefix, &out};
  dl_iterate_phdr(&visit, &s);
  return out;
}

std::array<int, 3> version_parts(int code) {
  if (code >= 10000) return {code / 10000, code % 10000 / 100, code % 100};
  return {code / 1000, code % 1000 / 100, code % 100};
}

std::string version_string(int code) {
  const auto [a, b, c] = version_parts(code);
  return fmt::format("{}.{}.{}", a, b, c);
}

std::string version_mismatch(int runtime, int header) {
  if (version_parts(runtime)[0] != version_parts(header)[0])
    return fmt::format("the NCCL library is version {}, but Baton was compiled against NCCL {} "
                       "(nccl.h): the major versions differ",
                       version_string(runtime), version_string(header));
  if (runtime < kMinVersionCode)
    return fmt::format("the NCCL library is version {}; Baton needs NCCL {} or newer "
                       "(non-blocking communicator setup, ncclCommInitRankConfig)",
                       version_string(runtime), version_string(kMinVersionCode));
  return {};
}

std::vector<Candidate> load_order(const std::vector<std::string>& mapped_paths, const char* env) {
  std::vector<Candidate> out;
  for (const std::string& p : mapped_paths) out.push_back({p, true});
  if (!out.empty()) return out;
  if (env != nullptr && *env != '\0') out.push_back({env, false});
  out.push_back({"libnccl.so.2", false});
  out.push_back({"libnccl.so", false});
  return out;
}

}  // namespace baton::runtime::nccl_library
