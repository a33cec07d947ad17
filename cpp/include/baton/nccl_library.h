// Finding and checking the NCCL library (host side, no CUDA: tested on any
// machine). The CUDA sources load NCCL with dlopen (cuda/nccl.cc nccl_api());
// these are the decisions they make.
//
// One copy of NCCL per process: JAX's CUDA plugin maps its own libnccl (from
// the nvidia-nccl wheel) when its GPU backend starts. Two copies in one process
// would each keep their own state (proxy threads, shared-memory segments,
// environment parsing), so Baton uses the copy already mapped when there is
// one (found with dl_iterate_phdr, opened with RTLD_NOLOAD), and only loads
// one itself ($BATON_NCCL_LIBRARY, then libnccl.so.2, libnccl.so) when none is.
#pragma once
#include <array>
#include <string>
#include <tuple>
#include <vector>

namespace baton::runtime::nccl_library {

// The oldest NCCL the CUDA path accepts: ncclCommInitRankConfig with a
// non-blocking config (2.14).
inline constexpr int kMinVersionCode = 21400;

// Paths of the shared objects mapped into this process whose file name (the
// part after the last '/') starts with `prefix`, in load order, without
// duplicates.
std::vector<std::string> mapped(const std::string& prefix);

// {major, minor, patch} of an NCCL version code (NCCL_VERSION's two encodings:
// X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after).
std::array<int, 3> version_parts(int code);
std::string version_string(int code);  // "2.28.9"

// Empty when a library reporting `runtime` (ncclGetVersion) may serve code
// compiled against `header` (NCCL_VERSION_CODE): same major, and at least
// kMinVersionCode; else a sentence saying why not, naming both versions.
std::string version_mismatch(int runtime, int header);

// A candidate library to open: `path`, and whether it is already mapped (then
// opened with RTLD_NOLOAD, so no second copy can be loaded by mistake).
struct Candidate {
  std::string path;
  bool mapped = false;
  bool operator==(const Candidate&) const = default;
};

// The order in which to try: the mapped copies (`mapped`, e.g. mapped("libnccl")),
// then `env` ($BATON_NCCL_LIBRARY; null or empty: none), then libnccl.so.2 and
// libnccl.so from the loader path. When a copy is mapped, only mapped copies are
// tried (loading another would make two).
std::vector<Candidate> load_order(const std::vector<std::string>& mapped, const char* env);

}  // namespace baton::runtime::nccl_library

namespace baton::runtime {

// (path, version code, whether it was already mapped, error) of the NCCL the
// CUDA path uses, loading it on the first call; ("", 0, false, why) when Baton
// was built without CUDA or NCCL could not be loaded.
std::tuple<std::string, int, bool, std::string> nccl_library_info();

}  // namespace baton::runtime
